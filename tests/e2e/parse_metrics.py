#!/usr/bin/python3
"""Parses Prometheus text files with prometheus_client's own parser (Debian's
python3-prometheus-client), an implementation independent of kvrelay's renderer, and prints
one JSON object per file: {"families": [{"name", "type", "samples": [{"name", "labels",
"value"}]}]}. A file the parser rejects makes it exit 1 with the parser's error.

Usage: parse_metrics.py FILE...
"""
import json
import math
import sys

from prometheus_client.parser import text_string_to_metric_families


def main(paths):
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        families = []
        try:
            for family in text_string_to_metric_families(text):
                samples = []
                for s in family.samples:
                    value = s.value
                    samples.append({
                        "name": s.name,
                        "labels": dict(s.labels),
                        # JSON has no infinities; +Inf buckets keep their label, not a value.
                        "value": value if math.isfinite(value) else None,
                    })
                families.append({"name": family.name, "type": family.type, "samples": samples})
        except Exception as e:  # the parser's errors are plain exceptions
            print(f"{path}: {e}", file=sys.stderr)
            return 1
        out.append({"path": path, "families": families})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
