"""Reports (HTML rendered in headless Chromium, Markdown) and MLflow tracking (server and sqlite)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess

import pytest

from qbuild.results.report import pareto, render_html

from helpers import fake_recipe, qbuild, run_api, write_recipe

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None

RUN = {  # the shape `qbuild run` records; numbers from the demo
    "recipe": "demo", "run_id": "r1", "store": "/s", "hardware": {"cpu": "test-cpu", "threads": 1},
    "protocol": {"protocol": "fixed-window", "context_length": 512},
    "variants": [
        {"variant": "baseline", "method": "-", "detail": "unquantized", "size_bytes": 541_000_000, "ppl": 17.84,
         "decode_tok_s": 18.1, "status": "cached"},
        {"variant": "f16", "method": "gguf", "detail": "F16", "size_bytes": 270_000_000, "ppl": 17.84,
         "delta_ppl": 0.0, "kld": 0.0, "top1": 0.998, "decode_tok_s": 28.0, "status": "cached"},
        {"variant": "q8_0", "method": "gguf", "detail": "Q8_0", "size_bytes": 144_000_000, "ppl": 17.98,
         "delta_ppl": 0.14, "kld": 0.004, "top1": 0.96, "decode_tok_s": 57.7, "status": "built"},
        {"variant": "q4km", "method": "gguf", "detail": "Q4_K_M", "size_bytes": 105_000_000, "ppl": 19.08,
         "delta_ppl": 1.24, "kld": 0.058, "top1": 0.873, "decode_tok_s": 75.7, "status": "built"},
    ],
    "gates": {"passed": False, "checks": [{"variant": "q4km", "check": "max_delta_ppl", "value": 1.24, "bound": 1.0,
                                           "passed": False, "by": 0.24}]},
}


def test_pareto_front():
    pts = [(100, 19.0, "q4"), (140, 18.0, "q8"), (270, 17.8, "f16"), (540, 17.8, "base"), (200, 19.5, "bad")]
    assert pareto(pts, lower_y_better=True) == {"q4", "q8", "f16"}
    assert pareto([(1, 5, "a"), (2, 9, "b"), (3, 4, "c")], lower_y_better=False) == {"a", "b"}


def test_html_report_is_self_contained_and_complete():
    page = render_html(RUN)
    assert page.count("<svg") == 3 and "KLD vs size" in page and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    for text in ("q4km", "19.080", "+1.240", "87.3%", "fixed-window", "test-cpu", "Quality gates: FAILED",
                 "Pareto front"):
        assert text in page


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_html_report_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_html(RUN))
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1000",
                    f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True, timeout=120)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000  # a page with a table and two plots, not a blank canvas


def _fake_run(tmp_path, store, **kwargs):
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [
        {"name": "small", "method": "fake"}, {"name": "big", "method": "fake", "level": 2}]))
    rc, summary = run_api(recipe, store, **kwargs)
    assert rc == 0, summary["steps"]
    return summary


def test_report_command_writes_html_and_markdown(tmp_path, store_dir):
    summary = _fake_run(tmp_path, store_dir)
    out = tmp_path / "r.html"
    res = qbuild("report", "t", "--store", store_dir, "--out", out)
    assert res.returncode == 0 and out.read_text().startswith("<!doctype html>")
    md = qbuild("report", summary["run_id"], "--store", store_dir, "--markdown").stdout
    assert md.startswith("# qbuild report · t") and "| small | fake |" in md
    missing = qbuild("report", "nope", "--store", store_dir)
    assert missing.returncode == 2 and "no run of recipe 'nope'" in missing.stderr


def _check_mlflow(uri: str, summary: dict):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("qbuild/t")
    runs = client.search_runs([exp.experiment_id])
    # exactly one MLflow run for this qbuild run (a shared server may hold other runs too)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags
               and r.data.tags.get("qbuild.run_id") == summary["run_id"]]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert parents[0].data.params["model.source"] == "local"
    by_variant = {r.data.tags["qbuild.variant"]: r for r in children}
    assert set(by_variant) == {"small", "big"}
    row = next(v for v in summary["variants"] if v["variant"] == "big")
    assert by_variant["big"].data.tags["qbuild.key"] == row["key"]
    assert by_variant["big"].data.metrics["size_bytes"] == row["size_bytes"]
    assert by_variant["big"].data.params["level"] == "2"
    names = {a.path for a in client.list_artifacts(by_variant["big"].info.run_id)}
    assert "manifest.json" in names
    assert {"summary.json", "report.html"} <= {a.path for a in client.list_artifacts(parents[0].info.run_id)}


@pytest.mark.skipif(not HAS_MLFLOW, reason="mlflow is not installed (pip install 'qbuild[mlflow]')")
def test_mlflow_sqlite_uri_without_server(tmp_path, store_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default artifact location ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = _fake_run(tmp_path, store_dir, mlflow=uri)
    assert summary["mlflow"]["run_id"]
    _check_mlflow(uri, summary)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_server_on_loopback(tmp_path, store_dir, mlflow_server):
    """A real `mlflow server` (sqlite backend, 127.0.0.1; the session's shared one from tests/servers.py)."""
    summary = _fake_run(tmp_path, store_dir, mlflow=mlflow_server["uri"])
    _check_mlflow(mlflow_server["uri"], summary)


def test_tracking_failure_warns_but_keeps_artifacts(tmp_path, store_dir):
    port = _free_port()  # nothing listens there
    recipe = write_recipe(tmp_path / "r.yaml", fake_recipe(tmp_path, [{"name": "a", "method": "fake"}]))
    res = qbuild(recipe, "--store", store_dir, "--mlflow", f"http://127.0.0.1:{port}",
                 env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"})
    if not HAS_MLFLOW:
        assert res.returncode == 2 and "pip install 'qbuild[mlflow]'" in res.stderr
        return
    assert res.returncode == 0
    assert "MLflow tracking" in res.stderr and "failed" in res.stderr
    assert qbuild("verify", "--store", store_dir).returncode == 0


# --- serving curves, SLO lines, the selected point; hardware in words; history axis labels ---------------------------
def _serving_run() -> dict:
    def pt(config, c, tok_s, ttft, tpot):
        return {"config": config, "concurrency": c, "output_tok_s": tok_s, "ttft_ms_p99": ttft, "ttft_ms_p50": ttft / 2,
                "tpot_ms_p50": tpot, "requests_s": tok_s / 32, "errors": 0}

    def quality(points, default, kv8):   # as the summary puts it on each point: (kld, ΔPPL %, PPL)
        for p in points:
            kv = p["config"] == "kv8"
            p.update(zip(("kld", "delta_ppl_pct", "ppl"), kv8 if kv else default, strict=True), peak_rss_mb=232 if kv else 294,
                     kv_cache_dtype="q8_0" if kv else None, kv_bytes_per_token=12240 if kv else 23040)
        return points

    run = {**RUN, "variants": [dict(v) for v in RUN["variants"]]}
    run["variants"][2]["serving"] = quality([pt("default", 1, 40, 90, 24), pt("default", 4, 110, 300, 35),
                                             pt("kv8", 1, 38, 95, 25), pt("kv8", 4, 100, 340, 38)],
                                            (0.004, 0.3, 17.9), (0.011, 0.9, 18.0))
    run["variants"][3]["serving"] = quality([pt("default", 1, 55, 70, 18), pt("default", 4, 150, 240, 26),
                                             pt("kv8", 1, 52, 72, 19), pt("kv8", 4, 140, 600, 28)],
                                            (0.058, 3.2, 18.35), (0.0712, 4.1, 18.5))
    run["selection"] = {"objective": "max_throughput", "concurrency": 4, "passed": True,
                        "bounds": {"ttft_p99_ms": {"value": 500, "concurrency": 4},
                                   "min_output_tok_s": {"value": 60, "concurrency": 4}},
                        "selected": {"variant": "q4km", "config": "default", "command": "llama-server --model m.gguf"},
                        "rejected": [{"variant": "q4km", "config": "kv8", "why": "ttft_p99_ms 600 ms at concurrency 4 "
                                      "> 500 (+100 ms, 20 %)"}]}
    return run


def test_serving_curves_slo_lines_and_selected_point():
    import re

    page = render_html(_serving_run())
    section = page[page.index('<section id="serving">'):]
    plots = re.findall(r'<svg[^>]*class="serving" data-variant="([^"]+)" data-metric="([^"]+)"', section)
    assert plots == [("q8_0", "ttft_ms_p99"), ("q8_0", "tpot_ms_p50"), ("q4km", "ttft_ms_p99"), ("q4km", "tpot_ms_p50")]
    first = section[:section.index("</svg>")]
    assert first.count('class="series"') == 2 and first.count("<polyline") == 2          # a line per config
    assert 'data-slo="ttft_ms_p99"' in first and 'data-slo="min_output_tok_s"' in first  # the SLO lines
    q4_ttft = section[section.index('data-variant="q4km" data-metric="ttft_ms_p99"'):]
    assert q4_ttft[:q4_ttft.index("</svg>")].count('class="selected"') == 1 and 'class="selected"' not in first
    assert "Selected: <b>q4km</b> @ <b>default</b>" in section and "+100 ms, 20 %" in section
    # each config's quality beside its KV-cache bytes: kv8's own pass, default the variant's own numbers
    table = section[section.index('<table class="config-quality">'):section.index("</table>")]
    assert ("<tr><td>q4km</td><td>kv8</td><td>q8_0</td><td>12,240</td><td>232 MiB</td><td>0.0712</td><td>+4.10 %</td>"
            "<td>18.500</td></tr>") in table
    assert "<tr><td>q4km</td><td>default</td><td>engine default</td><td>23,040</td><td>294 MiB</td><td>0.0580</td>" in table


def test_hardware_is_written_in_words():
    page = render_html(RUN)
    assert "hardware: test-cpu · 1 thread</p>" in page and "{&quot;cpu&quot;" not in page


def test_history_tick_labels_leave_room_for_the_axis_label():
    import re

    from qbuild.results.report import svg_lines

    svg = svg_lines({"q4km": [(0, 0.0045671, "a"), (1, 0.0051234, "b")]}, 2, "KLD", "kld")
    ticks = re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="end" font-size="11">([^<]+)</text>', svg)
    # a right-anchored tick label takes ~6.5 px a character; the rotated axis label sits at x=16 (±7 px)
    assert ticks and all(float(x) - 6.5 * len(label) > 16 + 7 for x, label in ticks)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_serving_report_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_html(_serving_run()))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert dom.count('class="serving"') == 4 and 'class="selected"' in dom
