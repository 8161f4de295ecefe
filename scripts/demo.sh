#!/usr/bin/env bash
# Set up, bring up the default network (links.json) on this host as testbed "demo"
# (subnet 10.76.0.0/16; EDGETB_ID and EDGETB_SUBNET choose others), and measure one
# shaped link with iperf3. The network stays up: look at it with
# `.venv/bin/edgetb --id demo status`, take it down with `.venv/bin/edgetb --id demo down`.
# A testbed id already in use (an earlier demo still up, a running experiment) is refused
# and left alone: this script takes nothing down.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export EDGETB_ID="${EDGETB_ID:-demo}" EDGETB_SUBNET="${EDGETB_SUBNET:-10.76.0.0/16}"
edgetb=.venv/bin/edgetb

if ! $edgetb up links.json; then
    echo "demo: testbed $EDGETB_ID was not brought up (see above). If an earlier demo left it up:" \
         "$edgetb --id $EDGETB_ID down; or choose another id: EDGETB_ID=demo2 EDGETB_SUBNET=10.75.0.0/16 $0" >&2
    exit 1
fi

src=n1; dst=n2
dst_ip=$($edgetb status --json | .venv/bin/python -c "import json,sys; print({n['name']: n['ip'] for n in json.load(sys.stdin)['nodes']}['$dst'])")
rate=$(.venv/bin/python -c "import json; print([l['bw'] for l in json.load(open('links.json'))['$src'] if l['dest']=='$dst'][0])")
echo "demo: measuring $src -> $dst ($dst_ip), configured $rate"
$edgetb exec $dst -- iperf3 -s -1 -D >/dev/null
sleep 0.5
$edgetb exec $src -- iperf3 -c "$dst_ip" -t 5 -O 1 -f m | grep -E "sender|receiver"
echo "demo: testbed $EDGETB_ID is still up. Try: $edgetb --id $EDGETB_ID exec n3 -- ip -br addr;" \
     "$edgetb --id $EDGETB_ID shape show n1;  $edgetb --id $EDGETB_ID down"
