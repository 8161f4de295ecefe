"""The one history of configured link rates: changes, lookups at a time, late reports, rates.csv rows."""
from __future__ import annotations

import csv
import io
import math

from controller.model.topology import Topology
from controller.results.rates import FROM_START, RATES_HEADER, LinkRates, rate_at


def test_a_history_starts_from_the_deployed_rates_and_records_each_change():
    rates = LinkRates({("a", "b"): 8_000_000})
    assert rates.now(("a", "b")) == 8_000_000 and rates.at(("a", "b"), -5.0) == 8_000_000
    assert rates.set(("a", "b"), 4_000_000, 2.0) and not rates.set(("a", "b"), 4_000_000, 3.0)
    assert rates.steps(("a", "b")) == [(FROM_START, 8_000_000), (2.0, 4_000_000)]
    assert [rates.at(("a", "b"), t) for t in (1.9, 2.0, 9.0)] == [8_000_000, 4_000_000, 4_000_000]
    assert rates.set(("b", "a"), 1_000_000, 5.0)  # a link added during the run: none before
    assert rates.at(("b", "a"), 4.0) is None and rates.now(("b", "a")) == 1_000_000
    rates.set(("b", "a"), None, 6.0)  # removed
    assert rates.now(("b", "a")) is None and rates.current() == {("a", "b"): 4_000_000}
    assert rates.keys() == [("a", "b"), ("b", "a")] and ("b", "a") in rates and ("c", "a") not in rates
    assert rates.now(("c", "a")) is None and rates.steps(("c", "a")) == []


def test_a_change_before_the_start_replaces_the_deployed_rate():
    rates = LinkRates({("a", "b"): 8_000_000})
    rates.set(("a", "b"), 2_000_000)
    assert rates.steps(("a", "b")) == [(FROM_START, 2_000_000)]


def test_a_late_report_goes_in_at_its_time_and_repeats_are_dropped():
    rates = LinkRates({("a", "b"): 20_000_000})
    rates.set(("a", "b"), 2_000_000, 0.2)  # the scenario's step, when the worker confirmed it
    assert not rates.set(("a", "b"), 20_000_000, 0.0)  # the telemetry, a second later, of the first sample
    assert not rates.set(("a", "b"), 2_000_000, 0.25)  # ... and of the sample that saw the change
    assert rates.steps(("a", "b")) == [(FROM_START, 20_000_000), (0.2, 2_000_000)]


def test_rate_at_holds_the_first_value_before_the_first_step():
    steps = [(1.0, 10.0), (3.0, None), (4.0, 5.0)]
    assert [rate_at(steps, t) for t in (0.0, 1.0, 3.5, 4.0, 9.0)] == [10.0, 10.0, None, 5.0, 5.0]
    assert rate_at([], 1.0) is None


def test_rows_of_rates_csv_read_back_as_the_same_history():
    rates = LinkRates({("a", "b"): 8000, ("b", "a"): 9000})
    rates.set(("a", "b"), 4000, 0.2)
    rates.set(("b", "a"), None, 0.2)
    rates.set(("a", "c"), 2000, 0.5)
    rows = rates.rows(0.0)
    assert rows == ["0.0000,a,b,8000\n", "0.0000,b,a,9000\n", "0.2000,a,b,4000\n", "0.2000,b,a,\n",
                    "0.5000,a,c,2000\n"]
    back = LinkRates.from_rows(csv.DictReader(io.StringIO(RATES_HEADER + "\n" + "".join(rows))),
                               {("a", "b"): 8000.0, ("c", "a"): 1000.0})
    assert back.steps(("a", "b")) == [(0.0, 8000.0), (0.2, 4000.0)]
    assert back.steps(("a", "c")) == [(-math.inf, None), (0.5, 2000.0)]  # added during the run
    assert back.steps(("c", "a")) == [(FROM_START, 1000.0)]  # no rows: the topology's from the start
    for key in (("a", "b"), ("b", "a"), ("a", "c")):
        assert [back.at(key, t) for t in (0.1, 0.3, 0.6)] == [rates.at(key, t) for t in (0.1, 0.3, 0.6)]


def test_a_topology_gives_the_deployed_rates():
    topo = Topology()
    topo.add_node("a")
    topo.add_node("b")
    topo.add_link("a", "b", "10mbit")
    assert LinkRates.of_topology(topo).steps(("a", "b")) == [(FROM_START, 10_000_000)]
