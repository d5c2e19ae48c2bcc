"""`pagedserve probe`: a health check for a container running one stage.

With --url it asks an HTTP endpoint (the gateway's /health) and is healthy on a 200;
it sends the API key of $PAGEDSERVE_API_KEY, which /health needs unless the gateway
runs with --metrics-public.
Otherwise it reads the file this container's stage writes with every heartbeat
($PAGEDSERVE_HEALTH_FILE, see shared/heartbeat.py) and is healthy when the last beat
is recent and says "ready". Exit 0 when healthy, 1 otherwise, with the reason printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from services.gateway.options import API_KEY_ENV
from shared.heartbeat import HEALTH_FILE_ENV

DEFAULT_MAX_AGE_S = 5.0


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="healthy when this URL answers 200")
    parser.add_argument("--file", default=os.environ.get(HEALTH_FILE_ENV), help=f"default ${HEALTH_FILE_ENV}")
    parser.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S, help="seconds a beat stays fresh")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for --url")


def check_url(url: str, timeout: float) -> tuple[bool, str]:
    key = os.environ.get(API_KEY_ENV)
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status == 200, f"{url}: {resp.status}"
    except urllib.error.HTTPError as err:
        return False, f"{url}: {err.code} {err.read(500).decode(errors='replace')}"
    except OSError as err:
        return False, f"{url}: {err}"


def check_file(path: str | None, max_age_s: float, now: float | None = None) -> tuple[bool, str]:
    if not path:
        return False, f"no heartbeat file: set {HEALTH_FILE_ENV} or pass --file"
    try:
        with open(path) as f:
            beat = json.load(f)
        age = (time.time() if now is None else now) - float(beat["sent_at"])
        state = beat["state"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return False, f"{path}: {err}"
    who = f"{beat.get('stage')} {beat.get('replica')}"
    if age > max_age_s:
        return False, f"{who}: last heartbeat {age:.1f} s ago"
    if state != "ready":
        return False, f"{who}: {state}"
    return True, f"{who}: ready"


def run(args: argparse.Namespace) -> int:
    healthy, why = check_url(args.url, args.timeout) if args.url else check_file(args.file, args.max_age)
    print(why, file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1
