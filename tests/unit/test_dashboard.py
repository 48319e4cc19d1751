"""The overview page from an overview's data, without a server: a model that is not loaded is
listed without buckets or bytes (no links to bucket pages it does not have), a failed one with
its reason, and the memory line in binary units. The real server's overview is checked in
``tests/e2e/test_dashboard.py``."""

from __future__ import annotations

import re
from typing import Any

from gateway.dashboard import render_index


def make_model_row(model: str, status: dict[str, str], buckets: list[str], resident_bytes: int | None) -> dict[str, Any]:
    return {"model": model, "task": "generate", "load": "on_demand", "status": status, "buckets": buckets,
            "resident_bytes": resident_bytes}


def make_overview(models: list[dict[str, Any]]) -> dict[str, Any]:
    resident = sum(m["resident_bytes"] or 0 for m in models)
    return {"models": models, "buckets": [], "memory_budget_bytes": 8 * 1024**3, "resident_bytes": resident}


def model_cells(page: str, model: str) -> list[str]:
    row = re.search(rf"<tr><td>{re.escape(model)}</td>(.*?)</tr>", page.split('<table id="models">')[1])
    assert row is not None, model
    return [model, *re.findall(r"<td>(.*?)</td>", row[1])]


def test_models_not_loaded_are_listed_without_buckets_or_bytes() -> None:
    page = render_index(make_overview([
        make_model_row("loaded-one", {"value": "loaded"}, ["le48", "le320"], 300 * 1024**2),
        make_model_row("resting", {"value": "unloaded"}, [], None),
        make_model_row("broken", {"value": "failed", "reason": "bad <safetensors> header"}, [], None),
    ]))
    assert model_cells(page, "loaded-one") == [
        "loaded-one", "generate", "on_demand", "loaded",
        '<a href="/dashboard/loaded-one/le48">le48</a>, <a href="/dashboard/loaded-one/le320">le320</a>', "300.00 MiB",
    ]
    assert model_cells(page, "resting") == ["resting", "generate", "on_demand", "unloaded", "", ""]
    assert model_cells(page, "broken") == ["broken", "generate", "on_demand", "failed: bad &lt;safetensors&gt; header", "", ""]
    assert "/dashboard/resting/" not in page and "/dashboard/broken/" not in page
    assert '<p id="memory">300.00 MiB resident, of the gateway\'s memory budget of 8.00 GiB.</p>' in page
    assert page.split('<table id="buckets">')[1].count("<tr>") == 1
