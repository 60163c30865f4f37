"""A two-node Ray cluster on this machine, on 127.0.0.1 only, for tests and benches: `python ray_cluster.py TMP`.

Started with Ray's own multi-node-on-one-machine API (ray.cluster_utils.Cluster, what Ray's test suite uses):
`ray start` cannot keep a second node on the loopback interface (it swaps 127.0.0.1 for the machine's
routable IP, and its servers then listen on every interface). RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray
take 127.0.0.1 as every node's address; the driver needs it too (RayCluster.env).

Node "head" (resources {"head": 1}) and node "worker2" ({"worker2": 1}), 1 CPU each, dashboard off, temp dir
and each node's local qbuild store (QBUILD_NODE_STORE) under TMP. Prints one JSON line {"address": ...}, then
reads commands from stdin: `kill worker2` (kills that node's processes at once, as a lost machine),
`stop` (or EOF) shuts everything down.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # loopback addresses for every node (read at import)


def main(tmp: str) -> None:
    os.environ["RAY_TMPDIR"] = tmp   # TMP/ray: sessions, sockets, logs and the cluster address file
    (Path(tmp) / "ray").mkdir(parents=True, exist_ok=True)
    import ray
    from ray.cluster_utils import Cluster

    root = Path(tmp)
    os.environ["QBUILD_NODE_STORE"] = str(root / "store-head")   # the head's raylet (and workers) inherit it
    common = {"num_cpus": 1, "include_dashboard": False, "temp_dir": str(root / "ray"), "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**common, "resources": {"head": 1}})
    nodes = {"worker2": cluster.add_node(**common, resources={"worker2": 1},
                                         env_vars={"QBUILD_NODE_STORE": str(root / "store-worker2")})}
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address, "node_ids": {"worker2": nodes["worker2"].node_id}}), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if cmd[:1] == ["kill"] and cmd[1] in nodes:
                cluster.remove_node(nodes.pop(cmd[1]), allow_graceful=False)
                print(json.dumps({"killed": cmd[1]}), flush=True)
            elif cmd[:1] == ["stop"]:
                break
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
