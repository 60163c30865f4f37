"""The plugin mechanism: a plugin is a class with a name, registered in a Registry of its kind, found in the
modules of the packages the registry is given (in-tree) and in the entry points of its group (out of tree), loaded
once, on first use. The kinds (methods, targets, runtimes, servers: qbuild.contract.plugin; remote stores:
qbuild.artifacts.remote) build on it; it names none of them."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import typing
from importlib import metadata
from typing import ClassVar, Generic, TypeVar

from qbuild.base.errors import MissingBackendError, UserError


class Plugin:
    name: ClassVar[str]
    extra: ClassVar[str] = ""                  # the pip extra (or package) that provides `requires`
    requires: ClassVar[tuple[str, ...]] = ()   # import names, checked with find_spec (never imported at plan time)
    origin: ClassVar[str] = "qbuild"           # set at registration: "qbuild" or the entry point's distribution

    @classmethod
    def missing(cls) -> list[str]:
        return [m for m in cls.requires if importlib.util.find_spec(m) is None]

    @classmethod
    def require(cls, field: str, what: str) -> None:
        """Raise the one-line error that names the extra to install, if a required module is missing."""
        missing = cls.missing()
        if missing:
            raise MissingBackendError(f"{what} needs the Python module {missing[0]!r}, which", cls.extra or cls.origin,
                                      field=field)


P = TypeVar("P", bound=Plugin)


class Registry(Generic[P]):
    """Plugins of one kind by name: the modules of `packages` (in-tree, registering with `register`)
    and the entry points of `group` (out of tree), loaded once, on first use."""

    def __init__(self, group: str, base: type[P], what: str, packages: tuple[str, ...] = (),
                 discriminator: str | None = None):
        self.group, self.base, self.what, self.packages = group, base, what, packages
        self.discriminator = discriminator  # the options field whose literal must be the plugin's name
        self._classes: dict[str, type[P]] = {}
        self._instances: dict[str, P] = {}
        self._loaded = False

    def register(self, cls: type[P]) -> type[P]:
        """Class decorator: make `cls` available under `cls.name`."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{cls!r} is not a {self.base.__name__} plugin")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} declares no name")
        known = self._classes.get(name)
        if known is not None and known is not cls:
            raise UserError(f"{self.what} {name!r} from {cls.origin} clashes with the one from {known.origin}")
        self._classes[name] = cls
        return cls

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for package in self.packages:
            pkg = importlib.import_module(package)
            for _leaf, module in sorted(plugin_modules(package, pkg.__path__)):
                importlib.import_module(module)
        for ep in metadata.entry_points(group=self.group):
            dist = ep.dist.name if ep.dist else "?"
            try:
                cls = ep.load()
            except Exception as exc:  # any import failure of someone else's package: one line, exit 2
                raise UserError(f"plugin {ep.name!r} ({self.group} = {ep.value}, from {dist}) failed to load: "
                                f"{type(exc).__name__}: {exc}") from None
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise UserError(f"plugin {ep.name!r} ({self.group} = {ep.value}, from {dist}) is not a "
                                f"{self.base.__module__}.{self.base.__name__} subclass")
            if cls.__dict__.get("origin") is None:
                cls.origin = dist
            self.register(cls)
        if self.discriminator:
            for cls in self._classes.values():
                _check_discriminator(cls, self.discriminator)

    def names(self) -> list[str]:
        self._load()
        return list(self._classes)

    def get(self, name: str) -> P:
        self._load()
        if name not in self._instances:
            self._instances[name] = self._classes[name]()
        return self._instances[name]

    def classes(self) -> list[type[P]]:
        self._load()
        return list(self._classes.values())

    def all(self) -> list[P]:
        return [self.get(n) for n in self.names()]

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._classes


def _check_discriminator(plugin: type[Plugin], field: str) -> None:
    """The options model's `method:`/`type:` literal must be the plugin's name (the recipe key maps 1:1)."""
    info = plugin.options.model_fields.get(field)
    if info is None or typing.get_args(info.annotation) != (plugin.name,):
        raise UserError(f"plugin {plugin.name!r} (from {plugin.origin}): its options model "
                        f"{plugin.options.__name__} must declare {field}: Literal[{plugin.name!r}]")


def plugin_modules(package: str, path: list[str]) -> list[tuple[str, str]]:
    """The in-tree plugin modules of `package` as (leaf name, module): its direct children and, for a family (a child
    package with subpackages: quantize/llmcompressor/gptq/), those subpackages, imported in order of the leaf name
    (the order plugins and formats are registered and listed in). Names starting with '_' are not plugins."""
    found = []
    for mod in pkgutil.iter_modules(path):
        if mod.name.startswith("_"):
            continue
        found.append((mod.name, f"{package}.{mod.name}"))
        if mod.ispkg:
            found += [(sub.name, f"{package}.{mod.name}.{sub.name}")
                      for sub in pkgutil.iter_modules([os.path.join(p, mod.name) for p in path])
                      if sub.ispkg and not sub.name.startswith("_")]
    return found
