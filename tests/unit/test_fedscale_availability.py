"""FedScale's client trace to an availability CSV: plain types only, never as root, checked."""
import os
import pickle
import subprocess
import sys
import tempfile
from collections import OrderedDict

import pytest

from controller.model import availability as av
from dml_tool import fedscale_availability as fa
from worker.api.errors import ConfigError

TRACE = {1: {"active": [0, 100], "inactive": [50], "finish_time": 200, "duration": 200},
         "2": {"active": [10.5], "inactive": [20], "finish_time": 20}}


def test_converts_intervals():
    text = fa.convert(pickle.dumps(TRACE), "trace", "out.csv")
    assert text.decode() == "node,t_on_s,t_off_s\n1,0,50\n1,100,\n2,10.5,20\n"
    got = av.by_name(av.parse_csv(text, "out.csv"))
    assert av.leave_return_s(got["1"], 1.0) == [(50.0, "leave"), (100.0, "return")]
    assert len(fa.trace_rows(TRACE, "t", max_clients=1)) == 2


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("data,needle", [
    (pickle.dumps(Boom()), "refused: the pickle asks for"),  # code on load: never run
    (pickle.dumps(OrderedDict(TRACE)), "refused: the pickle asks for collections.OrderedDict"),
    (b"node,t_on_s,t_off_s\n", "not a plain pickle"),
    (pickle.dumps([1, 2]), "expected a dict"),
    (pickle.dumps({1: {"active": [5], "inactive": [1, 2]}}), "1 'active' times for 2"),
    (pickle.dumps({1: {"active": [float("nan")]}}), "active[0]: expected seconds"),
    (pickle.dumps({1: {"active": [0, 5], "inactive": [10, 20]}}), "out.csv: line 3"),  # overlapping
])
def test_refusals_name_the_file(data, needle):
    with pytest.raises(ConfigError) as e:
        fa.convert(data, "trace.pkl", "out.csv")
    assert needle in str(e.value)


def test_refuses_to_run_as_root(tmp_path, monkeypatch, capsys):
    (tmp_path / "t.pkl").write_bytes(pickle.dumps(TRACE))
    monkeypatch.setattr(fa.os, "geteuid", lambda: 0)
    assert fa.main([str(tmp_path / "t.pkl"), str(tmp_path / "a.csv")]) == 2
    assert "refusing to run as root" in capsys.readouterr().err and not (tmp_path / "a.csv").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the tool as nobody, which needs root to switch to")
def test_as_an_ordinary_user():
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # (pytest's own folders are root's alone)
        os.chmod(d, 0o777)
        trace, out = os.path.join(d, "t.pkl"), os.path.join(d, "a.csv")
        with open(trace, "wb") as f:
            f.write(pickle.dumps(TRACE))
        os.chmod(trace, 0o644)
        done = subprocess.run([sys.executable, fa.__file__, trace, out], user="nobody", capture_output=True,
                              text=True, timeout=60, cwd="/")
        assert done.returncode == 0, done.stderr
        with open(out) as f:
            assert f.read().splitlines()[1] == "1,0,50"
