#!/usr/bin/env bash
# Set up, bring up the default network (links.json) on this host, and measure
# one shaped link with iperf3. The network stays up: look at it with
# `.venv/bin/edgetb status`, take it down with `.venv/bin/edgetb down`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
edgetb=.venv/bin/edgetb

$edgetb down >/dev/null 2>&1 || true
$edgetb up links.json

src=n1; dst=n2
dst_ip=$($edgetb status --json | .venv/bin/python -c "import json,sys; print({n['name']: n['ip'] for n in json.load(sys.stdin)['nodes']}['$dst'])")
rate=$(.venv/bin/python -c "import json; print([l['bw'] for l in json.load(open('links.json'))['$src'] if l['dest']=='$dst'][0])")
echo "demo: measuring $src -> $dst ($dst_ip), configured $rate"
$edgetb exec $dst -- iperf3 -s -1 -D >/dev/null
sleep 0.5
$edgetb exec $src -- iperf3 -c "$dst_ip" -t 5 -O 1 -f m | grep -E "sender|receiver"
echo "demo: the network is still up. Try: $edgetb exec n3 -- ip -br addr;  $edgetb shape show n1;  $edgetb down"
