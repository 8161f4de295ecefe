"""Split the dataset over the nodes and write their dataset confs:
``python3 dml_tool/dataset_conf.py -d gl_dataset.json`` (or ``-s fl_structure.json``: then ``-d``
defaults to that algorithm's dataset file, fl_dataset.json). Both dataset formats (settings and
EdgeTB's per-node one) are described in ``controller/confs/confs.py``.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from controller.bootstrap import use_venv  # noqa: E402

if __name__ == "__main__":
    use_venv(REPO, "dataset_conf.py", ("numpy", "sklearn"))

from controller.confs.confs import dataset_confs, load_dataset, load_structure, write_confs  # noqa: E402
from controller.confs.structures import ALGORITHMS, PREFIXES, guess_algorithm  # noqa: E402
from controller.model.topology import load_links  # noqa: E402
from worker.api.errors import TestbedError  # noqa: E402

DATASET_FILES = {algorithm: f"{prefix}_dataset.json" for prefix, algorithm in PREFIXES.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-d", "--dataset", help="dataset JSON (default: the algorithm's, e.g. gl_dataset.json)")
    parser.add_argument("-s", "--structure", default="gl_structure.json", help="which nodes take part")
    parser.add_argument("-a", "--algorithm", choices=ALGORITHMS,
                        help="what the structure file is for (default: by its name, e.g. fl_structure.json: fl)")
    parser.add_argument("-l", "--links", default="links.json")
    parser.add_argument("-w", "--workdir", default=".")
    args = parser.parse_args(argv)
    try:
        algorithm = args.algorithm or guess_algorithm(args.structure)
        dataset = args.dataset or os.path.join(os.path.dirname(args.structure), DATASET_FILES[algorithm])
        nodes = list(load_structure(args.structure, load_links(args.links), algorithm))
        for path in write_confs(args.workdir, "dataset", dataset_confs(load_dataset(dataset), nodes, args.workdir)):
            print(path)
    except TestbedError as e:
        print(f"dataset_conf.py: error: {e.message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
