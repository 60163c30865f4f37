"""The contract layer: what plugins implement and what the pipeline asks of them: the step (its key and the
context its runner gets), formats (who evaluates and loads an artifact), the plugin base classes and registries,
the variant options base, data sources, the backend environment a step carries (declared here; qbuild/envs/
creates them) and the evaluation protocol. It imports only qbuild.base. Plugin authors import it from the plugin
surface, qbuild.plugins (the evaluation protocol, which loads numpy, from qbuild.plugin_services)."""
