"""Who may read the dashboard and who may press its buttons: the real app on a real socket.

Reading (the page, the views, the stream) is what ``/status`` allows: any loopback caller (the
admin token is never taken in clear from another host). Changing a link from the page is a state
change: another local user is refused, a page of another origin is refused, the run's files stay in place."""
from __future__ import annotations

import json

import requests

from tests.security.callers_fixtures import NOBODY_UID, curl_as
from tests.security.test_controller_callers import ADMIN_TOKEN, lan_address, make_controller  # noqa: F401

LINK = json.dumps({"src": "n1", "dst": "n2", "bw": "1mbit"})


def test_other_local_users_read_the_dashboard_and_cannot_change_a_link(make_controller):
    exp, served, _ = make_controller()
    for path in ("/", "/api/view", "/api/runs", "/static/dashboard.js"):
        code, _ = curl_as(NOBODY_UID, "GET", served.url + path)
        assert code == 200, path
    code, body = curl_as(NOBODY_UID, "POST", served.url + "/api/link", data=LINK)
    assert code == 403 and body["error"] == "forbidden", body
    assert exp.topology.links[("n1", "n2")].shape.rate_bps == 10_000_000


def test_pages_of_other_origins_and_other_hosts_are_refused(make_controller):
    exp, served, _ = make_controller()
    for headers in ({"Origin": "http://attacker.example"}, {"Origin": f"http://localhost:{served.port + 1}"},
                    {"Sec-Fetch-Site": "cross-site"}, {"Host": "attacker.example"}):
        resp = requests.post(served.url + "/api/link", data=LINK, timeout=10,
                             headers={"Content-Type": "application/json", **headers})
        assert resp.status_code == 403, (headers, resp.text)
        assert requests.get(served.url + "/api/view", headers=headers, timeout=10).status_code == 403
    # path tricks on the run id never leave the experiment's log
    for run in ("..", "..%2F..%2Fetc", "%2e%2e"):
        assert requests.get(served.url + f"/api/runs/{run}", timeout=10).status_code == 404, run
    lan = lan_address()
    if lan is not None:  # from another host (not loopback) the page is refused; the token too, in clear
        url = f"http://{lan}:{served.port}"
        assert requests.get(url + "/", timeout=10).status_code == 401
        assert requests.get(url + "/api/view", timeout=10).status_code == 401
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert requests.get(url + "/api/view", headers=auth, timeout=10).status_code == 403
    assert exp.topology.links[("n1", "n2")].shape.rate_bps == 10_000_000
