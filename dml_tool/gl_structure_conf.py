"""Write each node's gossip structure conf: ``python3 dml_tool/gl_structure_conf.py -s gl_structure.json``.

(fl_structure_conf.py, el_structure_conf.py and ra_structure_conf.py do the same
for federated, E-tree and ring all-reduce structures.)

``connect`` lists the linked peers a node sends to (for gossip: its
out-neighbours in links.json; otherwise next hops, with ``forward`` naming the
relay for a destination it has no link to), with the addresses a fresh testbed
gives them (the controller re-checks them against the running testbed when it
pushes the confs).
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from controller.bootstrap import use_venv  # noqa: E402

if __name__ == "__main__":
    use_venv(REPO, "gl_structure_conf.py", ("numpy", "requests"))

from controller.confs.confs import load_structure, structure_confs, write_confs  # noqa: E402
from controller.model.topology import load_links  # noqa: E402
from controller.workers.deploy import planned_ips  # noqa: E402
from worker.api.errors import TestbedError  # noqa: E402
from worker.api.protocol import DEFAULT_SUBNET  # noqa: E402


def main(argv: list[str] | None = None, algorithm: str = "gossip") -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-s", "--structure", required=True, help="structure JSON, e.g. gl_structure.json or fl_structure.json")
    parser.add_argument("-l", "--links", default="links.json")
    parser.add_argument("-w", "--workdir", default=".", help="experiment directory (confs go to dml_file/conf)")
    parser.add_argument("--subnet", default=DEFAULT_SUBNET)
    args = parser.parse_args(argv)
    try:
        topology = load_links(args.links)
        confs = structure_confs(load_structure(args.structure, topology, algorithm), topology,
                                planned_ips(topology, args.subnet))
        for path in write_confs(args.workdir, "structure", confs):
            print(path)
    except TestbedError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
