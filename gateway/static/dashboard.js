// A bucket's live charts: polls the JSON named by <body data-api> every second and extends one
// Plotly chart per panel. Rates come from counter deltas between polls, divided by the server's
// clock (time_s); latency percentiles and finished-request throughput come from the server.
// window.sluiceDashboard exposes the number of polls and points drawn (the browser test reads it).
"use strict";

(function () {
  const POLL_MS = 1000;
  const MAX_POINTS = 600; // ten minutes of polls per trace
  const api = document.body.dataset.api;
  const state = { numPolls: 0, numPoints: 0, numErrors: 0, lastError: null };
  window.sluiceDashboard = state;

  const ms = (s) => (s === null || s === undefined ? null : 1000 * s);
  const perSecond = (key) => (s, d) => (d && d.dt > 0 ? d[key] / d.dt : null);

  // Each trace: [name, f(snapshot, delta or null) -> number or null, optional trace options].
  const CHARTS = [
    { id: "queue", title: "Queue depth and running sequences", traces: [
      ["queue depth", (s) => s.num_waiting],
      ["running", (s) => s.num_running],
    ] },
    { id: "batch", title: "Batch size (sequences per forward, mean between polls)", traces: [
      ["batch size", (s, d) => (d && d.num_steps > 0 ? d.num_batch_seqs_total / d.num_steps : null)],
    ] },
    { id: "ttft", title: "TTFT (ms, requests finished in the last 60 s)", traces: [
      ["p50", (s) => ms(s.recent.ttft_p50_s)],
      ["p99", (s) => ms(s.recent.ttft_p99_s)],
    ] },
    { id: "tpot", title: "TPOT (ms per output token, last 60 s)", traces: [
      ["p50", (s) => ms(s.recent.tpot_p50_s)],
      ["p99", (s) => ms(s.recent.tpot_p99_s)],
    ] },
    { id: "throughput", title: "Throughput", yaxis2: "requests/s", traces: [
      ["generated tokens/s (last 10 s)", (s) => s.recent.tokens_per_s],
      ["batched tokens/s (incl. prompts, padding)", perSecond("num_batched_tokens")],
      ["requests/s (last 10 s, right axis)", (s) => s.recent.requests_per_s, { yaxis: "y2", line: { dash: "dot" } }],
    ] },
    { id: "kv", title: "KV cache usage (%)", range: [0, 100], traces: [
      ["blocks used", (s) => 100 * s.kv_usage],
    ] },
    { id: "padding", title: "Padding waste (% of batched tokens, between polls)", traces: [
      ["padding", (s, d) => (d && d.num_batched_tokens > 0 ? 100 * d.num_padding_tokens / d.num_batched_tokens : null)],
    ] },
    { id: "rejections", title: "Rejections and failures (per second)", traces: [
      ["rejected (queue full)", perSecond("num_rejected")],
      ["timed out", perSecond("num_timed_out")],
      ["failed", perSecond("num_failed")],
      ["cancelled", perSecond("num_cancelled")],
    ] },
  ];

  function layout(chart) {
    const result = {
      title: { text: chart.title, font: { size: 13 } },
      margin: { l: 50, r: chart.yaxis2 ? 50 : 15, t: 30, b: 30 },
      showlegend: true,
      legend: { orientation: "h", y: -0.2, font: { size: 10 } },
      xaxis: { type: "date", tickformat: "%H:%M:%S" },
      yaxis: { rangemode: "tozero", range: chart.range },
    };
    if (chart.yaxis2) {
      result.yaxis2 = { title: { text: chart.yaxis2 }, overlaying: "y", side: "right", rangemode: "tozero" };
    }
    return result;
  }

  function setUp() {
    const container = document.getElementById("charts");
    for (const chart of CHARTS) {
      const div = document.createElement("div");
      div.className = "chart";
      div.id = "chart-" + chart.id;
      container.appendChild(div);
      const traces = chart.traces.map(([name, , options]) =>
        Object.assign({ name, x: [], y: [], mode: "lines", type: "scatter" }, options || {}));
      Plotly.newPlot(div, traces, layout(chart), { displaylogo: false, displayModeBar: false, responsive: true });
      chart.div = div;
    }
  }

  function delta(snapshot, previous) {
    if (!previous) return null;
    const d = { dt: snapshot.time_s - previous.time_s };
    for (const [key, value] of Object.entries(snapshot.counters)) {
      if (typeof value === "number") d[key] = Math.max(0, value - previous.counters[key]);
    }
    return d;
  }

  function draw(snapshot, previous) {
    const now = new Date();
    const d = delta(snapshot, previous);
    for (const chart of CHARTS) {
      const ys = chart.traces.map(([, f]) => [f(snapshot, d)]);
      const indices = chart.traces.map((_, i) => i);
      Plotly.extendTraces(chart.div, { x: indices.map(() => [now]), y: ys }, indices, MAX_POINTS);
      state.numPoints += indices.length;
    }
    const c = snapshot.counters;
    document.getElementById("status").textContent =
      `${snapshot.state} · ${snapshot.kind} batcher on slice ${snapshot.slice} · ` +
      `backend ${(snapshot.backend && snapshot.backend.running) || "eager"} ` +
      (snapshot.backend && snapshot.backend.gate_state ? `(gate ${snapshot.backend.gate_state}) ` : "") +
      `(busy ${(100 * snapshot.slice_busy_ratio).toFixed(0)}%) · queue ${snapshot.num_waiting} · ` +
      `running ${snapshot.num_running} · finished ${c.num_finished} · rejected ${c.num_rejected} · ` +
      `timed out ${c.num_timed_out} · failed ${c.num_failed}`;
    for (const [id, value] of [["config", snapshot.config], ["backend", snapshot.backend]]) {
      const text = JSON.stringify(value, null, 2);
      const pre = document.getElementById(id);
      if (pre.textContent !== text) pre.textContent = text;
    }
  }

  let previous = null;
  async function poll() {
    try {
      const response = await fetch(api, { cache: "no-store" });
      const body = await response.json();
      if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
      draw(body, previous);
      previous = body;
      state.numPolls += 1;
    } catch (error) {
      state.numErrors += 1;
      state.lastError = String(error);
      document.getElementById("status").textContent = "error: " + error;
    }
    setTimeout(poll, POLL_MS);
  }

  setUp();
  poll();
})();
