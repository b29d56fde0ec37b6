"""Scrapes the sidecar's /metrics twice, as Prometheus does (text 0.0.4) and
as an OpenMetrics scraper does, and parses each page with the Prometheus
project's own Python parsers (PyPI prometheus-client), which refuse a page
that breaks its format. Prints one JSON object: per format, the content type,
each family's type, and every sample as "name{k=v,...}" -> value.

Usage: scrape_metrics.py ADMIN_ADDR
"""

import json
import sys
import urllib.request

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def scrape(addr, accept, parse):
    headers = {"Accept": accept} if accept else {}
    request = urllib.request.Request(f"http://{addr}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        content_type = response.headers["Content-Type"]
        text = response.read().decode()
    families, samples = {}, {}
    for family in parse(text):
        families[family.name] = family.type
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return {"content_type": content_type, "families": families, "samples": samples}


def main():
    addr = sys.argv[1]
    print(
        json.dumps(
            {
                "prometheus": scrape(addr, None, parse_prometheus),
                "openmetrics": scrape(addr, OPENMETRICS, parse_openmetrics),
            }
        )
    )


if __name__ == "__main__":
    main()
