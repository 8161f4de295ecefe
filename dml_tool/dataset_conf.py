"""Split the dataset over the nodes and write their dataset confs:
``python3 dml_tool/dataset_conf.py -d gl_dataset.json -s gl_structure.json``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from controller.topology import load_links  # noqa: E402
from dml_tool.confs import dataset_confs, load_dataset, load_structure, write_confs  # noqa: E402
from dml_tool.structures import ALGORITHMS, guess_algorithm  # noqa: E402
from worker.errors import TestbedError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-d", "--dataset", required=True, help="dataset JSON, e.g. gl_dataset.json")
    parser.add_argument("-s", "--structure", default="gl_structure.json", help="which nodes take part")
    parser.add_argument("-a", "--algorithm", choices=ALGORITHMS,
                        help="what the structure file is for (default: by its name, e.g. fl_structure.json: fl)")
    parser.add_argument("-l", "--links", default="links.json")
    parser.add_argument("-w", "--workdir", default=".")
    args = parser.parse_args(argv)
    try:
        algorithm = args.algorithm or guess_algorithm(args.structure)
        nodes = list(load_structure(args.structure, load_links(args.links), algorithm))
        for path in write_confs(args.workdir, "dataset", dataset_confs(load_dataset(args.dataset), nodes, args.workdir)):
            print(path)
    except TestbedError as e:
        print(f"dataset_conf.py: error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
