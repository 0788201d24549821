"""The Prometheus exposition text of ServerMetrics, read back with parse_metrics (no server needed)."""

from __future__ import annotations

from labkit.server.metrics import PREFIX, ServerMetrics, parse_metrics


def test_rendered_metrics_parse_back_to_their_values():
    m = ServerMetrics()
    m.inc("requests_total", 3)
    m.inc("prompt_tokens_total", 120)
    for seconds in (0.004, 0.2, 0.2, 7.0):
        m.ttft.observe(seconds)
    samples = parse_metrics(m.render({"num_running_reqs": ("Requests in the running batch", 2)}))
    by_name = {(s["name"], s["labels"].get("le")): s for s in samples}

    running = by_name[(PREFIX + "num_running_reqs", None)]
    assert (running["value"], running["type"], running["help"]) == (2, "gauge", "Requests in the running batch")
    assert by_name[(PREFIX + "requests_total", None)]["value"] == 3
    assert by_name[(PREFIX + "prompt_tokens_total", None)]["type"] == "counter"
    ttft = PREFIX + "time_to_first_token_seconds"
    buckets = {le: by_name[(ttft + "_bucket", le)]["value"] for le in ("0.005", "0.25", "5.0", "10.0", "+Inf")}
    assert buckets == {"0.005": 1, "0.25": 3, "5.0": 3, "10.0": 4, "+Inf": 4}  # cumulative
    assert by_name[(ttft + "_count", None)]["value"] == 4
    assert by_name[(ttft + "_sum", None)]["value"] == 0.004 + 0.2 + 0.2 + 7.0
    assert {s["type"] for s in samples if s["name"].startswith(ttft)} == {"histogram"}
    assert len([s for s in samples if s["name"] == ttft + "_bucket"]) == len(m.ttft.buckets) + 1
