"""A client for a node: fetch the URL given three times, printing the time and rate of each.
See docs/how-to/programs.md."""
import sys
import time
import urllib.request

for attempt in range(3):
    started = time.monotonic()
    size = len(urllib.request.urlopen(sys.argv[1], timeout=30).read())
    seconds = time.monotonic() - started
    print(f"{size} bytes in {seconds:.2f} s: {size * 8 / seconds / 1e6:.2f} Mbit/s", flush=True)
