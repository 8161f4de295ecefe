"""The user's files: the structure file's model and algorithm fields, staging into dml_user/, the
deploy-time checks that need no sandbox, and the node loading the user's role classes."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from controller.confs import usercode
from controller.confs.structures import load_structure_file
from controller.model.topology import load_links
from dml_app.roles import registry
from dml_app.roles.fl import TrainerRole
from dml_app.roles.gossip import GossipRole
from dml_app.runtime.usercode import UserCodeError, load_file
from worker.api.errors import ConfigError

LINKS = {"n1": [{"dest": "n2", "bw": "10mbit"}], "n2": [{"dest": "n1", "bw": "10mbit"}]}


@pytest.fixture
def exp(tmp_path):
    (tmp_path / "links.json").write_text(json.dumps(LINKS))
    return tmp_path


def structure(exp, **top) -> dict:
    path = exp / "gl_structure.json"
    path.write_text(json.dumps({"sync": 2, "node_list": [{"name": "n1"}, {"name": "n2"}], **top}))
    return load_structure_file(str(path), load_links(str(exp / "links.json")), "gossip")


def test_a_module_model_keeps_its_own_keys_and_a_builtin_refuses_unknown_ones(exp):
    confs = structure(exp, model={"module": "nns/m.py", "width": 16, "layers": [3, 4], "seed": 5})
    assert confs["n1"]["model"] == {"module": "nns/m.py", "seed": 5, "width": 16, "layers": [3, 4]}  # (kind: inferred)
    with pytest.raises(ConfigError, match="'widht'"):
        structure(exp, model={"name": "lenet5", "widht": 16})
    with pytest.raises(ConfigError, match="either built-in .'name'. or your own .'module'."):
        structure(exp, model={"name": "lenet5", "module": "nns/m.py"})
    for bad in ("/etc/x.py", "../x.py", "nns/../../x.py", "m.txt"):
        with pytest.raises(ConfigError, match="'module'"):
            structure(exp, model={"module": bad})


def test_the_algorithm_field_names_a_file_and_its_classes(exp):
    confs = structure(exp, algorithm={"module": "algos/a.py", "role": "Mine", "beta": 0.5})
    assert confs["n2"]["algorithm"] == {"module": "algos/a.py", "classes": ["Mine"], "beta": 0.5}
    assert structure(exp, algorithm={"module": "a.py", "role": ["A", "B", "A"]})["n1"]["algorithm"]["classes"] == \
        ["A", "B"]
    for bad, words in (({"role": "A"}, "missing field 'module'"), ({"module": "a.py"}, "missing field 'role'"),
                       ({"module": "a.py", "role": "not a name"}, "class name"), ({"module": "a.py", "role": []},
                                                                                   "class name"),
                       ("a.py", "expected an object")):
        with pytest.raises(ConfigError, match=words):
            structure(exp, algorithm=bad)


def test_stage_copies_the_files_points_the_confs_at_them_and_clears_the_last_runs(exp):
    (exp / "nns").mkdir()
    (exp / "nns" / "m.py").write_text("def build(s, n, c): pass\n")
    (exp / "dml_user" / "old").mkdir(parents=True)
    (exp / "dml_user" / "old" / "stale.py").write_text("")
    confs = structure(exp, model={"module": "nns/m.py"})
    files = usercode.stage(str(exp), confs, "gl_structure.json")
    assert files == {"nns/m.py": os.path.join(os.path.realpath(exp), "dml_user", "nns", "m.py")}
    assert confs["n1"]["model"]["module"] == "dml_user/nns/m.py"
    assert (exp / "dml_user" / "nns" / "m.py").read_text() == "def build(s, n, c): pass\n"
    assert oct((exp / "dml_user" / "nns" / "m.py").stat().st_mode & 0o777) == "0o644"
    assert not (exp / "dml_user" / "old").exists()


def test_stage_refuses_a_missing_file_or_a_link_out_of_the_experiment(exp, tmp_path_factory):
    with pytest.raises(ConfigError, match="nns/m.py: no such file"):
        usercode.stage(str(exp), structure(exp, model={"module": "nns/m.py"}), "gl_structure.json")
    outside = tmp_path_factory.mktemp("outside") / "evil.py"
    outside.write_text("")
    os.symlink(outside, exp / "evil.py")
    with pytest.raises(ConfigError, match="outside the experiment directory"):
        usercode.stage(str(exp), structure(exp, model={"module": "evil.py"}), "gl_structure.json")
    assert not (exp / "dml_user").exists()  # nothing written


def test_check_builds_numpy_builtins_and_refuses_keras_on_docker_nodes(exp):
    os.makedirs(exp / "dataset")
    np.savez(exp / "dataset" / "n.npz", x_train=np.zeros((3, 8, 8, 1), np.float32), y_train=np.arange(3))
    dconfs = {n: {"shard": "dataset/n.npz", "n_classes": 10} for n in ("n1", "n2")}
    confs = structure(exp, model={"name": "edgetb_fashion_cnn"})
    described = usercode.check(str(exp), confs, dconfs, "gl_structure.json")
    assert described["n1"]["params"] == 45_674  # the 8x8x1 net, built once for both nodes
    assert list(described) == ["n1"]
    for kind, framework in (("keras", "TensorFlow"), ("torch", "PyTorch")):
        with pytest.raises(ConfigError, match=f"kind '{kind}' needs {framework} in the nodes, and the Docker node "
                                              "image has numpy only"):
            usercode.check(str(exp), structure(exp, model={"kind": kind, "name": "lenet5"}), dconfs,
                           "gl_structure.json", {"n1": "netns", "n2": "docker"})
    with pytest.raises(ConfigError, match="needs images of at least 4x4"):
        np.savez(exp / "dataset" / "n.npz", x_train=np.zeros((3, 2, 2, 1), np.float32), y_train=np.arange(3))
        usercode.check(str(exp), confs, dconfs, "gl_structure.json")


ROLES_FILE = '''
from dml_app.roles.gossip import GossipRole
from dml_app.roles.fl import TrainerRole

class Mine(GossipRole):
    pass

class Prox(TrainerRole):
    pass

class NotARole:
    name = "gossip"
'''


def test_the_node_uses_the_users_class_for_its_role_only(tmp_path):
    (tmp_path / "dml_user").mkdir()
    (tmp_path / "dml_user" / "r.py").write_text(ROLES_FILE)
    algorithm = {"module": "dml_user/r.py", "classes": ["Mine", "Prox"]}
    gossip = registry.role_class({"role": "gossip", "algorithm": algorithm}, str(tmp_path))
    assert gossip.__name__ == "Mine" and issubclass(gossip, GossipRole)
    trainer = registry.role_class({"role": "fl_trainer", "algorithm": algorithm}, str(tmp_path))
    assert trainer.__name__ == "Prox" and issubclass(trainer, TrainerRole)
    assert registry.role_class({"role": "fl_aggregator", "algorithm": algorithm}, str(tmp_path)).__name__ == \
        "AggregatorRole"
    with pytest.raises(UserCodeError, match="NotARole must subclass one of the built-in roles"):
        registry.role_class({"role": "gossip", "algorithm": {**algorithm, "classes": ["NotARole"]}}, str(tmp_path))
    with pytest.raises(UserCodeError, match="defines no class 'Nope'"):
        registry.role_class({"role": "gossip", "algorithm": {**algorithm, "classes": ["Nope"]}}, str(tmp_path))


def test_load_file_stays_in_the_experiment_directory_and_names_the_failing_line(tmp_path):
    (tmp_path / "bad.py").write_text("x = 1\nraise RuntimeError('no')\n")
    with pytest.raises(UserCodeError, match=r"bad.py: importing it failed: RuntimeError: no \(line 2\)"):
        load_file(str(tmp_path), "bad.py")
    for escape in ("../x.py", "/etc/passwd.py", "x.txt"):
        with pytest.raises(UserCodeError):
            load_file(str(tmp_path), escape)


def test_stage_refuses_a_linked_dml_user_and_files_in_the_testbeds_own_directories(exp, tmp_path_factory):
    (exp / "m.py").write_text("")
    victim = tmp_path_factory.mktemp("victim")
    (victim / "important").write_text("keep")
    os.symlink(victim, exp / "dml_user")
    with pytest.raises(ConfigError, match="is not a directory"):
        usercode.stage(str(exp), structure(exp, model={"module": "m.py"}), "gl_structure.json")
    assert (victim / "important").read_text() == "keep" and not (victim / "m.py").exists()
    os.unlink(exp / "dml_user")
    (exp / "dml_file").mkdir()
    (exp / "dml_file" / "x.py").write_text("")
    os.symlink(exp / "dml_file" / "x.py", exp / "linked.py")
    with pytest.raises(ConfigError, match="in the testbed's own"):
        usercode.stage(str(exp), structure(exp, model={"module": "linked.py"}), "gl_structure.json")
    for own in ("dml_user/m.py", "dml_file/x.py", "./m.py", "a//m.py", "__pycache__/m.py"):
        with pytest.raises(ConfigError, match="'module'"):
            structure(exp, model={"module": own})


NAMED_ROLES = '''
from dml_app.roles.fl import TrainerRole
from dml_app.roles.gossip import GossipRole

class Sneaky(TrainerRole):
    name = "gossip"

class One(GossipRole):
    pass

class Two(GossipRole):
    pass
'''


def test_a_class_replaces_the_role_it_subclasses_one_class_a_role(tmp_path):
    (tmp_path / "r.py").write_text(NAMED_ROLES)
    with pytest.raises(UserCodeError, match="Sneaky subclasses TrainerRole but names itself 'gossip'"):
        registry.role_class({"role": "gossip", "algorithm": {"module": "r.py", "classes": ["Sneaky"]}},
                            str(tmp_path))
    with pytest.raises(UserCodeError, match="One and Two both replace GossipRole"):
        registry.role_class({"role": "gossip", "algorithm": {"module": "r.py", "classes": ["One", "Two"]}},
                            str(tmp_path))


def test_stage_copies_the_policy_files_and_points_every_conf_at_them(exp):
    (exp / "policies").mkdir()
    (exp / "policies" / "mine.py").write_text("from dml_app.policies import Policy\n")
    confs = structure(exp, policies=[{"module": "policies/other.py", "class": "Other"},
                                     {"module": "policies/mine.py", "class": "Mine", "level": 2}])
    (exp / "policies" / "other.py").write_text("from dml_app.policies import Policy\n")
    files = usercode.stage(str(exp), confs, "gl_structure.json")
    staged = os.path.join(os.path.realpath(exp), "dml_user", "policies")
    assert files == {"policies/mine.py": os.path.join(staged, "mine.py"),
                     "policies/other.py": os.path.join(staged, "other.py")}
    for conf in confs.values():
        assert conf["policies"][1] == {"level": 2, "module": "dml_user/policies/mine.py", "class": "Mine"}
        assert conf["policies"][0] == {"module": "dml_user/policies/other.py", "class": "Other"}
    assert (exp / "dml_user" / "policies" / "mine.py").read_text() == "from dml_app.policies import Policy\n"
    with pytest.raises(ConfigError, match="policies/gone.py: no such file"):
        usercode.stage(str(exp), structure(exp, policies=[{"module": "policies/gone.py", "class": "G"}]),
                       "gl_structure.json")


def test_stage_brings_the_python_files_beside_a_users_file_and_not_the_testbeds(exp):
    (exp / "nns" / "pkg").mkdir(parents=True)
    (exp / "nns" / "glue.py").write_text("from helper import X\n")
    (exp / "nns" / "helper.py").write_text("X = 1\n")
    (exp / "nns" / "notes.txt").write_text("not code")
    (exp / "nns" / "pkg" / "__init__.py").write_text("")
    (exp / "nns" / "pkg" / "layers.py").write_text("")
    (exp / "top.py").write_text("def build(s, n, c): pass\n")
    (exp / "dml_app").mkdir()
    (exp / "dml_app" / "__init__.py").write_text("")  # (the testbed's own, at the top: left out)
    staged = usercode.stage(str(exp), structure(exp, model={"module": "nns/glue.py"}), "gl_structure.json")
    assert sorted(staged) == ["nns/glue.py", "nns/helper.py", "nns/pkg/__init__.py", "nns/pkg/layers.py"]
    module = load_file(str(exp), "dml_user/nns/glue.py")  # the staged copy imports its helper
    assert module.X == 1
    staged = usercode.stage(str(exp), structure(exp, model={"module": "top.py"}), "gl_structure.json")
    assert "top.py" in staged and not any(p.startswith("dml_app/") for p in staged), staged


def test_messages_name_the_users_path_not_the_staged_copy_and_list_what_the_file_defines(tmp_path):
    (tmp_path / "dml_user" / "nns").mkdir(parents=True)
    (tmp_path / "dml_user" / "nns" / "m.py").write_text("import json\nclass Net: pass\nnet = Net()\n")
    module = load_file(str(tmp_path), "dml_user/nns/m.py")
    with pytest.raises(UserCodeError) as e:
        from dml_app.runtime.usercode import attribute

        attribute(module, "dml_user/nns/m.py", "build", "function")
    assert str(e.value) == "nns/m.py: defines no function 'build' (it defines: Net, net; imported: json)"


ALGOS = {"shadowing": "from dml_app.roles.fl import AggregatorRole\n\n\nclass Mine(AggregatorRole):\n"
                      "    def aggregation(self, current, updates, counts):\n        return updates[0]\n",
         "etree": "from dml_app.roles.etree import ETreeRole\n\n\nclass Mine(ETreeRole):\n"
                  "    def aggregations(self):\n        return {}\n"}


@pytest.mark.parametrize("case", sorted(ALGOS))
def test_a_method_named_like_the_rule_object_is_refused_naming_aggregate(tmp_path, case):
    (tmp_path / "a.py").write_text(ALGOS[case])
    with pytest.raises(UserCodeError, match=r"a.py: Mine.aggregations? \(line 5\) is a method.*define "
                                            r"aggregate\(self, current, updates, counts\) -> weights"):
        registry.user_roles(str(tmp_path), "a.py", ["Mine"])


def test_an_aggregate_method_names_the_round_and_the_rule_otherwise():
    from dml_app.reduction.aggregation import Aggregator
    from dml_app.roles.fl import AggregatorRole
    from dml_app.roles.shared import rule_name

    class Median(AggregatorRole):
        def aggregate(self, current, updates, counts):
            return updates[0]

    class Plain(AggregatorRole):
        pass

    role, plain = object.__new__(Median), object.__new__(Plain)
    assert rule_name(role, AggregatorRole, Aggregator()) == "Median.aggregate"
    assert rule_name(plain, AggregatorRole, Aggregator({"rule": "median"})) == "median"
