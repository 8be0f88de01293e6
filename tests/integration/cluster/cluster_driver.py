"""A multi-node Ray cluster on 127.0.0.1 (``ray.cluster_utils.Cluster``), driven over stdin so tests can
add nodes and kill them (SIGKILL, no graceful shutdown). Commands: ``add``, ``kill I``, ``quit``."""

import os
import sys

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep every node on 127.0.0.1 (read at import)

from ray.cluster_utils import Cluster  # noqa: E402

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
print("ADDRESS", cluster.address, flush=True)
nodes = []
for line in sys.stdin:
    cmd = line.split()
    if not cmd:
        continue
    if cmd[0] == "add":
        nodes.append(cluster.add_node(num_cpus=1))
        cluster.wait_for_nodes()
    elif cmd[0] == "kill":
        cluster.remove_node(nodes.pop(int(cmd[1])), allow_graceful=False)
    elif cmd[0] == "quit":
        break
    print("OK", flush=True)
cluster.shutdown()
print("BYE", flush=True)
