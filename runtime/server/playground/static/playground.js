// ignis Playground: Chat (streamed, with timings beside each reply) and Monitor (/metrics + /status).
// Talks only to the server's own API by relative URLs; sends `Authorization: Bearer KEY` once a key is
// given. No dependencies, no build step.
"use strict";
(() => {
  const API = { chat: "../v1/chat/completions", metrics: "../metrics", status: "../status" };
  const KEY_STORE = "ignis.playground.apiKey";
  const POLL_MS = 1000;
  const HISTORY = 120; // points kept per plot (two minutes at one poll a second)
  const $ = (id) => document.getElementById(id);

  let apiKey = sessionStorage.getItem(KEY_STORE) || localStorage.getItem(KEY_STORE) || "";
  let status = null; // last /status
  let conversation = []; // {role, content}
  let inflight = null; // AbortController of the streaming reply
  let prev = null; // previous metrics sample {t, m}
  const hist = { tokps: [], tpr: [], active: [], waiting: [], rounds: [] };

  // ------------------------------------------------------------------ HTTP

  class AuthError extends Error {}

  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    if (apiKey) h.Authorization = "Bearer " + apiKey;
    return h;
  }

  async function errorText(r) {
    try {
      const j = await r.json();
      return (j.error && j.error.message) || `${r.status} ${r.statusText}`;
    } catch (e) {
      return `${r.status} ${r.statusText}`;
    }
  }

  async function api(url, opts) {
    opts = opts || {};
    const r = await fetch(url, Object.assign({ cache: "no-store" }, opts, { headers: authHeaders(opts.headers) }));
    if (r.status === 401) {
      askKey(await errorText(r));
      throw new AuthError("this server needs an API key");
    }
    return r;
  }

  // ------------------------------------------------------------------ Prometheus text

  // name -> [{labels, value}] of the text exposition format (0.0.4).
  function parseMetrics(text) {
    const out = new Map();
    const line_re = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
    const label_re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = line_re.exec(line);
      if (!m) continue;
      const labels = {};
      if (m[2]) for (const l of m[2].matchAll(label_re)) labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      const raw = m[3];
      const value = raw === "+Inf" ? Infinity : raw === "-Inf" ? -Infinity : Number(raw);
      if (!out.has(m[1])) out.set(m[1], []);
      out.get(m[1]).push({ labels, value });
    }
    return out;
  }

  function sum(m, name, pred) {
    const rows = m.get(name);
    if (!rows) return null;
    let s = 0;
    for (const r of rows) if (!pred || pred(r.labels)) s += r.value;
    return s;
  }

  function byPosition(m, name) {
    const out = [];
    for (const r of m.get(name) || []) out[Number(r.labels.position)] = r.value;
    for (let i = 0; i < out.length; i++) if (out[i] === undefined) out[i] = 0;
    return out;
  }

  // The q-quantile of a Prometheus histogram from its cumulative buckets, interpolated linearly inside
  // the bucket it falls in (PromQL's histogram_quantile); null without observations.
  function quantile(m, name, q) {
    const buckets = (m.get(name + "_bucket") || [])
      .map((r) => ({ le: r.labels.le === "+Inf" ? Infinity : Number(r.labels.le), n: r.value }))
      .sort((a, b) => a.le - b.le);
    if (!buckets.length) return null;
    const total = buckets[buckets.length - 1].n;
    if (!total) return null;
    const rank = q * total;
    let lo = 0, below = 0;
    for (const b of buckets) {
      if (b.n >= rank) {
        if (b.le === Infinity) return lo;
        return lo + ((b.le - lo) * (rank - below)) / Math.max(b.n - below, 1e-12);
      }
      lo = b.le;
      below = b.n;
    }
    return lo;
  }

  // The figures the Playground reads from /metrics.
  function figures(m) {
    return {
      rounds: sum(m, "ignis_speculative_rounds_total") || 0,
      drafted: sum(m, "ignis_speculative_drafted_tokens_total") || 0,
      accepted: sum(m, "ignis_speculative_accepted_tokens_total") || 0,
      posDrafted: byPosition(m, "ignis_speculative_position_drafted_total"),
      posAccepted: byPosition(m, "ignis_speculative_position_accepted_total"),
      generated: sum(m, "ignis_generation_tokens_total") || 0,
      prompt: sum(m, "ignis_prompt_tokens_total") || 0,
      ttftSum: sum(m, "ignis_time_to_first_token_seconds_sum") || 0,
      ttftCount: sum(m, "ignis_time_to_first_token_seconds_count") || 0,
      itlSum: sum(m, "ignis_inter_token_latency_seconds_sum") || 0,
      itlCount: sum(m, "ignis_inter_token_latency_seconds_count") || 0,
      finished: sum(m, "ignis_request_finished_total") || 0,
      active: sum(m, "ignis_lanes_active"),
      waiting: sum(m, "ignis_requests_waiting"),
      lanesMax: sum(m, "ignis_lanes_max"),
    };
  }

  async function readMetrics() {
    const r = await api(API.metrics);
    if (!r.ok) throw new Error(await errorText(r));
    return parseMetrics(await r.text());
  }

  // ------------------------------------------------------------------ formatting

  const fmt = (x, d) => (x === null || x === undefined || !isFinite(x) ? "–" : x.toFixed(d));
  function fmtMs(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    return s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 1 : 0)} ms` : `${s.toFixed(2)} s`;
  }
  function fmtBytes(b) {
    if (b === null || b === undefined) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return `${b.toFixed(i ? 1 : 0)} ${u[i]}`;
  }
  function fmtCount(x) {
    if (x === null || x === undefined) return "–";
    return x >= 1e6 ? `${(x / 1e6).toFixed(2)} M` : x >= 1e4 ? `${(x / 1e3).toFixed(1)} k` : String(Math.round(x));
  }
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function specText(s) {
    if (!s || s.backend === "off") return "speculation off";
    return `${s.backend} × ${s.draft_tokens}`;
  }

  // ------------------------------------------------------------------ API key dialog

  let keyDismissed = false; // the user closed the dialog: the polls do not reopen it

  function askKey(reason, fromUser) {
    const dlg = $("key-dialog");
    $("conn").className = "dot bad";
    $("conn").title = "the server needs an API key";
    if (keyDismissed && !fromUser) return;
    $("key-reason").textContent = reason || "This server needs an API key (ignis-run --api-key).";
    if (!dlg.open) dlg.showModal();
    $("key-input").focus();
  }

  function setupKeyDialog() {
    $("key-button").addEventListener("click", () => askKey("The key is sent as 'Authorization: Bearer KEY'.", true));
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      apiKey = $("key-input").value.trim();
      sessionStorage.setItem(KEY_STORE, apiKey);
      if ($("key-remember").checked) localStorage.setItem(KEY_STORE, apiKey);
      $("key-input").value = "";
      keyDismissed = false;
      $("key-dialog").close();
      refreshStatus().then(poll);
    });
    $("key-forget").addEventListener("click", () => {
      apiKey = "";
      sessionStorage.removeItem(KEY_STORE);
      localStorage.removeItem(KEY_STORE);
      $("key-input").value = "";
    });
    $("key-cancel").addEventListener("click", () => { keyDismissed = true; $("key-dialog").close(); });
    $("key-dialog").addEventListener("cancel", () => { keyDismissed = true; }); // Escape
  }

  // ------------------------------------------------------------------ status

  async function refreshStatus() {
    try {
      const r = await api(API.status);
      if (!r.ok) throw new Error(await errorText(r));
      status = await r.json();
      $("conn").className = "dot ok";
      $("conn").title = "server up";
      $("model-name").textContent = status.model;
      $("spec-badge").textContent = specText(status.speculative);
      const s = status.speculative;
      const info = $("spec-info");
      info.replaceChildren();
      const rows = [["backend", s.backend]];
      if (s.backend !== "off") {
        rows.push(["draft tokens", s.draft_tokens], ["row budget", s.draft_rows || 8], ["proposal head", s.draft_head]);
      }
      rows.push(["lanes", status.lanes.max], ["context", status.max_context === null ? "model's" : status.max_context]);
      for (const [k, v] of rows) { info.append(el("dt", "", k), el("dd", "", String(v))); }
      renderGpu();
    } catch (e) {
      $("conn").className = "dot bad";
      $("conn").title = String(e.message || e);
    }
  }

  // ------------------------------------------------------------------ chat

  function readSettings() {
    const out = {};
    for (const [name, parse] of [["temperature", Number], ["top_p", Number], ["top_k", Number], ["max_tokens", Number], ["seed", Number]]) {
      const raw = $("set-" + name).value.trim();
      if (raw !== "") out[name] = parse(raw);
    }
    return out;
  }

  function settingsLine(settings) {
    const parts = Object.entries(settings).map(([k, v]) => `${k} ${v}`);
    parts.push(specText(status && status.speculative));
    return parts.join(" · ");
  }

  function addMessage(role, text) {
    const empty = $("chat-empty");
    if (empty) empty.remove();
    const box = el("div", "msg " + role);
    box.append(el("div", "role", role), el("div", "text", text));
    $("messages").append(box);
    box.scrollIntoView({ block: "end" });
    return box;
  }

  // A row of small bars (inline SVG), one per draft position: accepted / drafted.
  function acceptanceBars(rates) {
    const ns = "http://www.w3.org/2000/svg";
    const w = 10, gap = 3, h = 18;
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("width", String(rates.length * (w + gap)));
    svg.setAttribute("height", String(h));
    svg.setAttribute("role", "img");
    rates.forEach((r, i) => {
      const bg = document.createElementNS(ns, "rect");
      bg.setAttribute("x", String(i * (w + gap))); bg.setAttribute("y", "0");
      bg.setAttribute("width", String(w)); bg.setAttribute("height", String(h));
      bg.setAttribute("fill", "#8884");
      const fg = document.createElementNS(ns, "rect");
      const bh = Math.max(0, Math.min(1, r)) * h;
      fg.setAttribute("x", String(i * (w + gap))); fg.setAttribute("y", String(h - bh));
      fg.setAttribute("width", String(w)); fg.setAttribute("height", String(bh));
      fg.setAttribute("fill", "#d9480f");
      const title = document.createElementNS(ns, "title");
      title.textContent = `position ${i}: ${(r * 100).toFixed(0)} % accepted`;
      svg.append(bg, fg, title);
    });
    return svg;
  }

  function timing(box, key, label, value, title) {
    const span = el("span", "");
    span.dataset.k = key;
    if (title) span.title = title;
    span.append(label + " ");
    const b = el("b", "", value);
    span.append(b);
    box.append(span);
    return span;
  }

  // Speculative figures of one reply: the response's usage extension when the server reports one
  // (usage.speculative: rounds, accepted_tokens, position_drafted[], position_accepted[]), else the
  // /metrics deltas around the request (exact when no other request ran meanwhile).
  function replySpec(usage, before, after) {
    const ext = usage && usage.speculative;
    if (ext && typeof ext.rounds === "number") {
      return {
        rounds: ext.rounds, accepted: ext.accepted_tokens,
        posDrafted: ext.position_drafted || [], posAccepted: ext.position_accepted || [],
        source: "the response's usage", shared: false,
      };
    }
    if (!before || !after) return null;
    const d = (a, b) => a - b;
    const n = Math.max(after.posDrafted.length, before.posDrafted.length);
    const posD = [], posA = [];
    for (let i = 0; i < n; i++) {
      posD.push(d(after.posDrafted[i] || 0, before.posDrafted[i] || 0));
      posA.push(d(after.posAccepted[i] || 0, before.posAccepted[i] || 0));
    }
    const completion = usage ? usage.completion_tokens : null;
    const generated = after.generated - before.generated;
    return {
      rounds: after.rounds - before.rounds, accepted: after.accepted - before.accepted,
      posDrafted: posD, posAccepted: posA, source: "/metrics deltas",
      shared: completion !== null && generated !== completion,
      ttft: after.ttftCount - before.ttftCount === 1 ? after.ttftSum - before.ttftSum : null,
    };
  }

  function showTimings(box, r) {
    const t = el("div", "timings");
    const ttft = r.tFirst === null ? null : (r.tFirst - r.t0) / 1000;
    timing(t, "ttft", "TTFT", fmtMs(ttft), "time to first token, measured in the browser (queueing and prefill included)");
    const n = r.usage ? r.usage.completion_tokens : r.chunks;
    const decodeS = r.tLast !== null && r.tFirst !== null ? (r.tLast - r.tFirst) / 1000 : 0;
    const tps = n > 1 && decodeS > 0 ? (n - 1) / decodeS : null;
    timing(t, "tps", "tok/s", fmt(tps, 1), "output tokens after the first / time from the first token to the last");
    timing(t, "tokens", "tokens", String(n), "completion tokens");
    if (r.usage) {
      const details = r.usage.prompt_tokens_details;
      const cached = details && details.cached_tokens ? ` (${details.cached_tokens} cached)` : "";
      timing(t, "prompt", "prompt", `${r.usage.prompt_tokens}${cached}`, "prompt tokens; cached: reused from a prompt checkpoint");
    }
    const s = r.spec;
    if (s && s.rounds > 0) {
      const approx = s.shared ? "≈" : "";
      timing(t, "tpr", "tokens/round", approx + fmt(s.accepted / s.rounds, 2),
        `${s.accepted} tokens in ${s.rounds} speculative lane-rounds (${s.source}` +
        (s.shared ? "; other requests ran meanwhile, so the figures include theirs)" : ")"));
      const rates = s.posDrafted.map((dr, i) => (dr > 0 ? s.posAccepted[i] / dr : 0));
      const acc = timing(t, "accept", "acceptance",
        rates.map((x) => (x * 100).toFixed(0)).join("/") + " %", "draft acceptance by position (0 first)");
      acc.append(" ", acceptanceBars(rates));
    } else {
      timing(t, "tpr", "tokens/round", "–", status && status.speculative.backend === "off"
        ? "speculation is off on this server" : "no speculative round in this reply");
    }
    if (s && s.ttft !== null && s.ttft !== undefined) {
      timing(t, "server-ttft", "server TTFT", fmtMs(s.ttft), "from the server's histogram (submission to first token)");
    }
    timing(t, "finish", "finish", r.finish || "–", "finish_reason");
    t.append(el("span", "settings-line", r.settingsLine));
    box.append(t);
  }

  async function sendMessage(ev) {
    if (ev) ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || inflight) return;
    $("prompt").value = "";
    conversation.push({ role: "user", content: text });
    const userBox = addMessage("user", text);
    const settings = readSettings();
    const system = $("set-system").value.trim();
    const messages = system ? [{ role: "system", content: system }, ...conversation] : conversation.slice();
    const body = Object.assign({ messages, stream: true, stream_options: { include_usage: true } }, settings);
    if (status) body.model = status.model;

    const box = addMessage("assistant", "");
    box.classList.add("streaming");
    const textEl = box.querySelector(".text");
    const controller = new AbortController();
    inflight = controller;
    $("send").disabled = true;
    $("stop").disabled = false;
    const r = { t0: 0, tFirst: null, tLast: null, chunks: 0, finish: null, usage: null, text: "",
      settingsLine: settingsLine(settings), spec: null };
    let before = null;
    try {
      before = figures(await readMetrics());
    } catch (e) {
      if (e instanceof AuthError) { // the key dialog is open: the message is given back for after it
        box.remove();
        userBox.remove();
        conversation.pop();
        $("prompt").value = text;
        endReply(null);
        askKey("This server needs an API key to answer (ignis-run --api-key).", true);
        return;
      }
    }
    let failed = null;
    r.t0 = performance.now();
    try {
      const resp = await api(API.chat, {
        method: "POST", body: JSON.stringify(body),
        headers: { "Content-Type": "application/json" }, signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await errorText(resp));
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, i);
          buf = buf.slice(i + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") continue;
            const obj = JSON.parse(data);
            if (obj.error) throw new Error(obj.error.message);
            if (obj.usage) r.usage = obj.usage;
            const choice = obj.choices && obj.choices[0];
            if (!choice) continue;
            const now = performance.now();
            if (r.tFirst === null) r.tFirst = now;
            r.tLast = now;
            r.chunks++;
            const delta = choice.delta && choice.delta.content;
            if (delta) { r.text += delta; textEl.textContent = r.text; }
            if (choice.finish_reason) r.finish = choice.finish_reason;
          }
        }
        box.scrollIntoView({ block: "end" });
      }
    } catch (e) {
      if (e.name === "AbortError") r.finish = "stopped (Stop button)";
      else if (e instanceof AuthError) failed = "the server needs an API key: give it and send again";
      else failed = String(e.message || e);
    }
    if (failed !== null && r.chunks === 0) { // refused (4xx/5xx) or unreachable: the message is given back
      box.remove();
      userBox.remove();
      conversation.pop();
      addMessage("error", failed).querySelector(".role").textContent = "error";
      $("prompt").value = text;
      endReply(null);
      return;
    }
    if (r.text) {
      conversation.push({ role: "assistant", content: r.text });
    } else { // stopped before any text: the turn is left out of the conversation
      conversation.pop();
      userBox.classList.add("dropped");
      userBox.title = "not part of the conversation (no reply)";
    }
    let after = null;
    try { after = figures(await readMetrics()); } catch (e) { /* shown as "–" */ }
    r.spec = replySpec(r.usage, before, after);
    if (failed !== null) r.finish = "error: " + failed;
    showTimings(box, r);
    endReply(box);
  }

  function endReply(box) {
    if (box) { box.classList.remove("streaming"); box.dataset.done = "1"; }
    inflight = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }

  function setupChat() {
    $("composer").addEventListener("submit", sendMessage);
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) sendMessage(ev);
    });
    $("stop").addEventListener("click", () => { if (inflight) inflight.abort(); });
    $("clear").addEventListener("click", () => {
      if (inflight) inflight.abort();
      conversation = [];
      $("messages").replaceChildren(el("p", "hint", "Conversation cleared."));
    });
  }

  // ------------------------------------------------------------------ monitor

  function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

  function sizeCanvas(c) {
    const dpr = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.round(c.clientWidth * dpr)), h = Math.max(1, Math.round(c.clientHeight * dpr));
    if (c.width !== w || c.height !== h) { c.width = w; c.height = h; }
    const ctx = c.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, c.clientWidth, c.clientHeight);
    return { ctx, w: c.clientWidth, h: c.clientHeight };
  }

  function niceMax(x) {
    if (!(x > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(x)));
    for (const m of [1, 2, 2.5, 5, 10]) if (x <= m * p) return m * p;
    return 10 * p;
  }

  // Lines over the last HISTORY polls; null values leave gaps.
  function plotLines(canvas, series, opts) {
    if (!canvas.clientWidth) return;
    const { ctx, w, h } = sizeCanvas(canvas);
    const left = 36, bottom = 16, top = 6, right = 6;
    let max = opts.min || 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > max) max = v;
    max = niceMax(max);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = css("--dim");
    ctx.strokeStyle = css("--line");
    ctx.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const y = top + (h - top - bottom) * (1 - f);
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w - right, y); ctx.stroke();
      ctx.fillText(fmt(max * f, max * f < 10 && f ? 1 : 0), 2, y + 3);
    }
    ctx.fillText(`−${Math.round((HISTORY * POLL_MS) / 1000)} s`, left, h - 3);
    ctx.fillText("now", w - right - 18, h - 3);
    const xs = (i) => left + ((w - left - right) * i) / (HISTORY - 1);
    const ys = (v) => top + (h - top - bottom) * (1 - v / max);
    ctx.lineWidth = 1.8;
    for (const s of series) {
      ctx.strokeStyle = css(s.color);
      ctx.beginPath();
      const off = HISTORY - s.values.length;
      let pen = false;
      s.values.forEach((v, i) => {
        if (v === null) { pen = false; return; }
        if (pen) ctx.lineTo(xs(off + i), ys(v)); else ctx.moveTo(xs(off + i), ys(v));
        pen = true;
      });
      ctx.stroke();
      ctx.fillStyle = ctx.strokeStyle; // a point with no neighbour is a dot
      s.values.forEach((v, i) => {
        const lone = v !== null && (i === 0 || s.values[i - 1] === null) && (i === s.values.length - 1 || s.values[i + 1] === null);
        if (lone) { ctx.beginPath(); ctx.arc(xs(off + i), ys(v), 2.5, 0, 2 * Math.PI); ctx.fill(); }
      });
    }
  }

  function plotBars(canvas, rates, drafted) {
    if (!canvas.clientWidth) return;
    const { ctx, w, h } = sizeCanvas(canvas);
    ctx.font = "10px system-ui, sans-serif";
    ctx.fillStyle = css("--dim");
    if (!rates.length) {
      ctx.fillText(status && status.speculative.backend === "off" ? "speculation is off on this server"
        : "no speculative round yet", 8, h / 2);
      return;
    }
    const left = 30, bottom = 16, top = 12;
    const slot = (w - left) / rates.length;
    const bw = Math.min(48, slot * 0.7);
    ctx.strokeStyle = css("--line");
    for (const f of [0, 0.5, 1]) {
      const y = top + (h - top - bottom) * (1 - f);
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w, y); ctx.stroke();
      ctx.fillText(`${f * 100}%`, 2, y + 3);
    }
    rates.forEach((r, i) => {
      const x = left + slot * i + (slot - bw) / 2;
      const bh = (h - top - bottom) * r;
      ctx.fillStyle = css("--c2");
      ctx.fillRect(x, top + (h - top - bottom) - bh, bw, bh);
      ctx.fillStyle = css("--dim");
      ctx.fillText(`${(r * 100).toFixed(0)}%`, x, top + (h - top - bottom) - bh - 2);
      ctx.fillText(`#${i}`, x + bw / 2 - 6, h - 3);
    });
    canvas.title = rates.map((r, i) => `position ${i}: ${(r * 100).toFixed(1)} % of ${drafted[i]} drafts`).join("\n");
  }

  function push(arr, v) { arr.push(v); if (arr.length > HISTORY) arr.shift(); }

  function renderGpu() {
    const g = status && status.gpu;
    if (!g) {
      $("mon-gpu").textContent = "no CUDA device in use";
      $("mon-gpu-sub").textContent = "this server runs on the CPU";
      $("mon-gpu-bar").style.width = "0";
      return;
    }
    $("mon-gpu").textContent = `${fmtBytes(g.used_bytes)} / ${fmtBytes(g.total_bytes)}`;
    $("mon-gpu-bar").style.width = `${((100 * g.used_bytes) / g.total_bytes).toFixed(1)}%`;
    $("mon-gpu-sub").textContent = `${g.name} · ignis tensors ${fmtBytes(g.allocated_bytes)}, ` +
      `reserved ${fmtBytes(g.reserved_bytes)}, peak ${fmtBytes(g.peak_allocated_bytes)}`;
  }

  const CACHE_PREFIXES = [
    ["ignis_prompt_checkpoint_", "Prompt checkpoints (prefix cache)"],
    ["ignis_prefix_cache_", "Prefix cache"],
    ["ignis_expert_cache_", "Expert cache"],
    ["ignis_expert_", "Experts"],
  ];

  function renderCaches(m) {
    const box = $("mon-caches");
    box.replaceChildren();
    const seen = new Set();
    for (const [prefix, title] of CACHE_PREFIXES) {
      const names = [...m.keys()].filter((n) => n.startsWith(prefix) && !seen.has(n) && !/_(created|bucket)$/.test(n));
      if (!names.length) continue;
      names.forEach((n) => seen.add(n));
      const table = el("table", "cache-table");
      const hits = sum(m, prefix + "hits_total"), lookups = sum(m, prefix + "lookups_total");
      const rows = [];
      if (hits !== null && lookups !== null) rows.push(["hit rate", lookups ? `${((100 * hits) / lookups).toFixed(1)} %` : "–"]);
      for (const n of names) {
        const v = sum(m, n);
        const short = n.slice(prefix.length).replace(/_total$/, "");
        rows.push([short, /bytes/.test(n) ? fmtBytes(v) : fmtCount(v)]);
      }
      for (const [k, v] of rows) {
        const tr = el("tr");
        tr.append(el("td", "", k), el("td", "", v));
        table.append(tr);
      }
      box.append(el("h3", "", title), table);
    }
    if (!box.childElementCount) box.append(el("p", "hint", "No prefix-cache or expert-cache metrics on this server."));
  }

  function renderRequests(m, f) {
    const dl = $("mon-requests");
    dl.replaceChildren();
    const rows = [["prompt tokens", fmtCount(f.prompt)], ["output tokens", fmtCount(f.generated)]];
    for (const r of m.get("ignis_request_finished_total") || []) rows.push([`finished: ${r.labels.finish_reason}`, fmtCount(r.value)]);
    const errors = sum(m, "ignis_requests_total", (l) => !/^2/.test(l.status));
    if (errors !== null) rows.push(["refused / failed (HTTP ≥ 400)", fmtCount(errors)]);
    for (const [k, v] of rows) dl.append(el("dt", "", k), el("dd", "", v));
  }

  function renderMonitor(m, f, rates) {
    $("mon-lanes").textContent = `${f.active ?? "–"} / ${f.lanesMax ?? "–"}`;
    $("mon-lanes-sub").textContent = "decoding or prefilling";
    $("mon-queued").textContent = f.waiting ?? "–";
    $("mon-queue-sub").textContent = status ? `of ${status.lanes.queue_size} allowed` : "";
    $("mon-tokps").textContent = fmt(rates.tokps, rates.tokps >= 100 ? 0 : 1);
    $("mon-gen").textContent = `${fmtCount(f.generated)} tokens in all`;
    $("mon-rounds").textContent = fmt(rates.rounds, 1);
    $("mon-rounds-total").textContent = `${fmtCount(f.rounds)} lane-rounds in all`;
    $("mon-tpr").textContent = f.rounds ? fmt(f.accepted / f.rounds, 2) : "–";
    $("mon-tpr-sub").textContent = f.rounds ? `${fmtCount(f.drafted)} drafted, ${fmtCount(f.accepted)} committed`
      : status && status.speculative.backend === "off" ? "speculation off" : "no speculative round yet";
    const ttft = "ignis_time_to_first_token_seconds", itl = "ignis_inter_token_latency_seconds";
    $("mon-ttft").textContent = fmtMs(quantile(m, ttft, 0.5));
    $("mon-itl").textContent = `TTFT p50 (p95 ${fmtMs(quantile(m, ttft, 0.95))}); inter-token p50 ` +
      `${fmtMs(quantile(m, itl, 0.5))}, p95 ${fmtMs(quantile(m, itl, 0.95))}; since start`;
    renderRequests(m, f);
    renderCaches(m);
    if ($("view-monitor").hidden) return;
    plotLines($("plot-tokps"), [{ values: hist.tokps, color: "--c1" }], {});
    plotLines($("plot-tpr"), [{ values: hist.tpr, color: "--c2" }], { min: 1 });
    plotLines($("plot-lanes"), [{ values: hist.active, color: "--c1" }, { values: hist.waiting, color: "--c3" }], { min: f.lanesMax || 1 });
    plotLines($("plot-rounds"), [{ values: hist.rounds, color: "--c4" }], {});
    const acc = f.posDrafted.map((d, i) => (d > 0 ? f.posAccepted[i] / d : 0));
    plotBars($("plot-accept"), acc, f.posDrafted);
  }

  let lastM = null, lastF = null, lastRates = {};
  async function poll() {
    if (document.hidden && prev) return; // a background tab does not poll (its history pauses)
    try {
      if (!$("view-monitor").hidden) await refreshStatus(); // lanes and GPU memory every poll
      const m = await readMetrics();
      const f = figures(m);
      const t = performance.now();
      const rates = {};
      if (prev) {
        const dt = (t - prev.t) / 1000;
        rates.tokps = (f.generated - prev.f.generated) / dt;
        rates.rounds = (f.rounds - prev.f.rounds) / dt;
        const dr = f.rounds - prev.f.rounds;
        push(hist.tokps, rates.tokps);
        push(hist.rounds, rates.rounds);
        push(hist.tpr, dr > 0 ? (f.accepted - prev.f.accepted) / dr : null);
        push(hist.active, f.active);
        push(hist.waiting, f.waiting);
      }
      prev = { t, f };
      lastM = m; lastF = f; lastRates = rates;
      $("conn").className = "dot ok";
      renderMonitor(m, f, rates);
    } catch (e) {
      $("conn").className = "dot bad";
      $("conn").title = String(e.message || e);
    }
  }

  // ------------------------------------------------------------------ tabs and start

  function show(view) {
    for (const b of document.querySelectorAll("nav button")) b.setAttribute("aria-selected", String(b.dataset.view === view));
    $("view-chat").hidden = view !== "chat";
    $("view-monitor").hidden = view !== "monitor";
    if (location.hash !== "#" + view) history.replaceState(null, "", "#" + view);
    if (view === "monitor" && lastM) renderMonitor(lastM, lastF, lastRates);
  }

  function start() {
    setupKeyDialog();
    setupChat();
    for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => show(b.dataset.view));
    window.addEventListener("resize", () => { if (lastM) renderMonitor(lastM, lastF, lastRates); });
    window.addEventListener("hashchange", () => show(location.hash === "#monitor" ? "monitor" : "chat"));
    show(location.hash === "#monitor" ? "monitor" : "chat");
    refreshStatus().then(poll);
    setInterval(poll, POLL_MS);
    setInterval(refreshStatus, 5 * POLL_MS);
  }

  start();
})();
