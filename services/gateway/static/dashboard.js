// pagedserve dashboard: reads /dashboard/stream (Server-Sent Events over fetch, so the API key
// travels in the Authorization header) and draws each engine's KV block pool, its sequences'
// block tables, the Figure 2 accounting and the gateway's throughput and latency history.
// Block states arrive packed (one byte per block; owners uint32, reference counts and fill
// uint16, little-endian), base64-encoded in JSON. No dependencies.
"use strict";

(function () {
  const STREAM_URL = location.pathname.replace(/\/+$/, "") + "/stream";
  const HISTORY_S = 300;
  const COLORS = { free: "#232a37", cached: "#7f8fa6", swapped: "#e8a13a", reserved: "#4b5466" };
  const ACCOUNTING = [
    ["token_states", "token states", "#3ecf6e"],
    ["reserved", "reserved", "#5fb3ff"],
    ["internal_frag", "internal fragmentation", "#e5534b"],
    ["external_frag", "external fragmentation", "#b07cf0"],
    ["free", "free", "#2c3444"],
  ];
  const $ = (sel, root = document) => root.querySelector(sel);

  let blockStates = ["free", "owned", "shared", "cached", "swapped", "reserved"];
  let history = [];
  const engines = new Map(); // key -> Panel
  let apiKey = keyFromFragment() || sessionStorage.getItem("pagedserve-key") || "";
  let controller = null;
  let retryMs = 500;

  // --- helpers ----------------------------------------------------------------------

  function keyFromFragment() {
    const m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
    return m ? decodeURIComponent(m[1]) : "";
  }

  function bytes(b64) {
    const s = atob(b64 || "");
    const out = new Uint8Array(s.length);
    for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }

  function unpack(b64, size) {
    const b = bytes(b64);
    const view = new DataView(b.buffer);
    const n = Math.floor(b.length / size);
    const out = size === 2 ? new Uint16Array(n) : new Uint32Array(n);
    for (let i = 0; i < n; i++) out[i] = size === 2 ? view.getUint16(i * 2, true) : view.getUint32(i * 4, true);
    return out;
  }

  function hue(id) {
    let h = 2166136261;
    for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619);
    return ((h >>> 0) % 360);
  }
  const requestColor = (id, light = 56) => `hsl(${hue(id)}, 70%, ${light}%)`;

  function fmt(n, digits = 0) {
    if (n === null || n === undefined || Number.isNaN(n)) return "–";
    return Number(n).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: digits });
  }

  function setStatus(state, text) {
    $("#status").dataset.state = state;
    $("#status-text").textContent = text;
  }

  function scaleCanvas(canvas, cssHeight) {
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || canvas.parentElement.clientWidth;
    canvas.style.height = cssHeight + "px";
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(cssHeight * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(cssHeight * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return [ctx, w, cssHeight];
  }

  // --- the tooltip ------------------------------------------------------------------

  const tooltip = $("#tooltip");
  function showTip(ev, text) {
    tooltip.textContent = text;
    tooltip.hidden = false;
    const x = Math.min(ev.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8);
    const y = Math.min(ev.clientY + 14, window.innerHeight - tooltip.offsetHeight - 8);
    tooltip.style.left = x + "px";
    tooltip.style.top = y + "px";
  }
  const hideTip = () => { tooltip.hidden = true; };

  // --- a grid of blocks --------------------------------------------------------------

  class Grid {
    constructor(canvas, describe) {
      this.canvas = canvas;
      this.describe = describe; // block -> tooltip text
      this.n = 0;
      this.cell = 10;
      this.cols = 1;
      canvas.addEventListener("mousemove", (ev) => {
        const b = this.blockAt(ev);
        if (b === null) return hideTip();
        showTip(ev, this.describe(b));
      });
      canvas.addEventListener("mouseleave", hideTip);
    }

    layout(n, width) {
      const gap = n > 4000 ? 0 : 1;
      let cell = Math.floor(Math.sqrt((width * 260) / Math.max(n, 1)));
      cell = Math.max(3, Math.min(22, cell));
      this.gap = cell >= 6 ? gap : 0;
      this.cell = cell;
      this.cols = Math.max(1, Math.floor((width + this.gap) / (cell + this.gap)));
      this.n = n;
      return Math.ceil(n / this.cols) * (cell + this.gap);
    }

    blockAt(ev) {
      const r = this.canvas.getBoundingClientRect();
      const step = this.cell + this.gap;
      const col = Math.floor((ev.clientX - r.left) / step);
      const row = Math.floor((ev.clientY - r.top) / step);
      if (col < 0 || col >= this.cols || row < 0) return null;
      const b = row * this.cols + col;
      return b < this.n ? b : null;
    }

    center(b) {
      const r = this.canvas.getBoundingClientRect();
      const step = this.cell + this.gap;
      return { x: r.left + (b % this.cols) * step + this.cell / 2, y: r.top + Math.floor(b / this.cols) * step + this.cell / 2 };
    }

    draw(n, paint) {
      const width = this.canvas.parentElement.clientWidth;
      const height = this.layout(n, width);
      const [ctx, w, h] = scaleCanvas(this.canvas, Math.max(height, 1));
      ctx.clearRect(0, 0, w, h);
      const step = this.cell + this.gap;
      for (let b = 0; b < n; b++) {
        paint(ctx, b, (b % this.cols) * step, Math.floor(b / this.cols) * step, this.cell);
      }
    }
  }

  // --- one engine's panel -------------------------------------------------------------

  class Panel {
    constructor(key) {
      this.key = key;
      const node = $("#engine-template").content.firstElementChild.cloneNode(true);
      node.dataset.engine = key;
      $("#engines").appendChild(node);
      this.node = node;
      this.pool = new Grid($("canvas.pool", node), (b) => this.describeBlock(b));
      this.swap = new Grid($("canvas.swap", node), (b) => this.describeSwap(b));
      this.rowNodes = new Map();
      this.snap = null;
      const legend = $(".legend", node);
      for (const name of blockStates) {
        const span = document.createElement("span");
        span.innerHTML = `<i class="swatch"></i>${name} <b data-count="${name}">0</b>`;
        span.dataset.state = name;
        legend.appendChild(span);
      }
      this.legendSwatches();
      const tbody = $(".numbers tbody", node);
      for (const [field, label, color] of ACCOUNTING) {
        const tr = document.createElement("tr");
        tr.innerHTML = `<td><i style="background:${color}"></i>${label}</td><td class="n" data-slots="${field}"></td><td class="n" data-share="${field}"></td>`;
        tbody.appendChild(tr);
        const seg = document.createElement("div");
        seg.style.background = color;
        seg.dataset.segment = field;
        seg.title = label;
        $(".bar", node).appendChild(seg);
      }
    }

    legendSwatches() {
      for (const span of this.node.querySelectorAll(".legend span")) {
        const i = $("i", span);
        const name = span.dataset.state;
        if (name === "owned") i.style.background = "linear-gradient(90deg, hsl(20,70%,56%), hsl(200,70%,56%))";
        else if (name === "shared") {
          i.style.background = "hsl(200,70%,40%)";
          i.style.boxShadow = "inset 0 0 0 2px #fff";
        } else i.style.background = COLORS[name];
      }
    }

    update(snap) {
      const s = {
        ...snap,
        states: bytes(snap.states),
        owners: unpack(snap.owners, 4),
        refs: unpack(snap.ref_counts, 2),
        fill: unpack(snap.fill, 2),
        swapStates: bytes(snap.swap_states),
        swapOwners: unpack(snap.swap_owners, 4),
      };
      // every holder of each block, from the listed sequences' tables
      s.holders = new Map();
      snap.rows.forEach((row, i) => {
        row.block_table.forEach((b, logical) => {
          if (!s.holders.has(b)) s.holders.set(b, []);
          s.holders.get(b).push([i, logical]);
        });
      });
      this.snap = s;
      this.render();
    }

    render() {
      const s = this.snap;
      if (!s) return;
      const node = this.node;
      $(".title", node).textContent =
        `${s.engine} · ${s.kv_policy} · ${fmt(s.num_blocks)} blocks × ${s.block_size} tokens`;
      const hits = s.prefix_cache_queries_total ? (100 * s.prefix_cache_hits_total) / s.prefix_cache_queries_total : null;
      $(".stats", node).innerHTML =
        `running <b>${s.num_running}</b> · waiting <b>${s.num_waiting}</b> · swapped out <b>${s.num_swapped}</b>` +
        ` · preemptions <b>${fmt(s.num_preemptions_total)}</b>` +
        (s.num_swap_blocks ? ` (swapped out ${fmt(s.num_swapped_out_total)}, in ${fmt(s.num_swapped_in_total)})` : "") +
        ` · prefix cache hits <b>${hits === null ? "–" : fmt(hits, 1) + "%"}</b>`;

      const counts = new Array(blockStates.length).fill(0);
      for (let b = 0; b < s.num_blocks; b++) counts[s.states[b]]++;
      for (let b = 0; b < s.num_swap_blocks; b++) if (s.swapStates[b]) counts[s.swapStates[b]]++;
      blockStates.forEach((name, i) => { $(`[data-count="${name}"]`, node).textContent = fmt(counts[i]); });

      $(".policy-note", node).textContent = s.kv_policy === "paged"
        ? "(paged: blocks on demand, no external fragmentation)"
        : `(${s.kv_policy}: contiguous reservations, buddy allocator)`;
      const total = s.num_blocks * s.block_size;
      const inUse = total - s.kv_slots_free;
      for (const [field] of ACCOUNTING) {
        const slots = s["kv_slots_" + field];
        $(`[data-segment="${field}"]`, node).style.width = (100 * slots) / Math.max(total, 1) + "%";
        $(`[data-slots="${field}"]`, node).textContent = fmt(slots) + " slots";
        const share = field === "free" ? (100 * slots) / Math.max(total, 1) : inUse ? (100 * slots) / inUse : 0;
        $(`[data-share="${field}"]`, node).textContent =
          fmt(share, 1) + (field === "free" ? "% of pool" : "% of used");
      }
      $(".pool-note", node).textContent = `(${fmt(s.num_blocks - counts[0] - counts[3])} held, ${fmt(counts[3])} cached, ${fmt(counts[0])} free; hover a cell)`;

      this.pool.draw(s.num_blocks, (ctx, b, x, y, size) => this.paintBlock(ctx, b, x, y, size));
      const swapWrap = $(".swap-wrap", node);
      swapWrap.hidden = !s.num_swap_blocks;
      if (s.num_swap_blocks) {
        $(".swap-note", node).textContent = `(${fmt(s.num_swap_blocks)} host blocks)`;
        this.swap.draw(s.num_swap_blocks, (ctx, b, x, y, size) => {
          const owner = s.swapOwners[b];
          ctx.fillStyle = s.swapStates[b] ? (owner ? requestColor(s.rows[owner - 1].request_id, 50) : COLORS.swapped) : COLORS.free;
          ctx.fillRect(x, y, size, size);
          if (s.swapStates[b] && size >= 6) {
            ctx.strokeStyle = COLORS.swapped;
            ctx.lineWidth = 1.5;
            ctx.strokeRect(x + 0.75, y + 0.75, size - 1.5, size - 1.5);
          }
        });
      }
      this.renderRows();
    }

    paintBlock(ctx, b, x, y, size) {
      const s = this.snap;
      const state = blockStates[s.states[b]];
      if (state === "owned" || state === "shared") {
        const owner = s.owners[b];
        const id = owner ? s.rows[owner - 1].request_id : "?";
        const filled = Math.min(1, s.fill[b] / s.block_size);
        ctx.fillStyle = requestColor(id, state === "shared" ? 42 : 56);
        ctx.globalAlpha = 0.35;
        ctx.fillRect(x, y, size, size);
        ctx.globalAlpha = 1;
        const h = Math.round(size * filled);
        ctx.fillRect(x, y + size - h, size, h);
        if (state === "shared") {
          ctx.strokeStyle = "#ffffff";
          ctx.lineWidth = size >= 8 ? 2 : 1;
          ctx.strokeRect(x + ctx.lineWidth / 2, y + ctx.lineWidth / 2, size - ctx.lineWidth, size - ctx.lineWidth);
          if (size >= 14) {
            ctx.fillStyle = "#fff";
            ctx.font = `bold ${Math.floor(size * 0.55)}px system-ui`;
            ctx.textAlign = "center";
            ctx.textBaseline = "middle";
            ctx.fillText(String(s.refs[b]), x + size / 2, y + size / 2 + 1);
          }
        }
      } else if (state === "reserved") {
        ctx.fillStyle = COLORS.reserved;
        ctx.fillRect(x, y, size, size);
      } else {
        ctx.fillStyle = COLORS[state] || COLORS.free;
        ctx.fillRect(x, y, size, size);
      }
    }

    describeBlock(b) {
      const s = this.snap;
      const state = blockStates[s.states[b]];
      const lines = [`block ${b} · ${state} · ${s.refs[b]} reference${s.refs[b] === 1 ? "" : "s"} · fill ${s.fill[b]}/${s.block_size}`];
      const byRequest = new Map();
      for (const [i, logical] of s.holders.get(b) || []) {
        const row = s.rows[i];
        if (!byRequest.has(row.request_id)) byRequest.set(row.request_id, []);
        byRequest.get(row.request_id).push(`  seq ${row.seq_index} · logical block ${logical}`);
      }
      for (const [id, seqs] of byRequest) lines.push(id, ...seqs);
      if (state === "cached") lines.push("in the prefix cache, held by nobody (evictable)");
      if (state === "reserved") lines.push("in a reservation's chunk, no table lists it: held for a fork that has not started, or the allocator's rounding");
      return lines.join("\n");
    }

    describeSwap(b) {
      const s = this.snap;
      const owner = s.swapOwners[b];
      if (!s.swapStates[b]) return `host block ${b} · free`;
      const row = owner ? s.rows[owner - 1] : null;
      return `host block ${b} · swapped` + (row ? `\n${row.request_id} seq ${row.seq_index} · logical block ${row.swapped_blocks.indexOf(b)}` : "");
    }

    renderRows() {
      const s = this.snap;
      const tbody = $(".rows tbody", this.node);
      $(".rows-note", this.node).textContent = s.num_rows_total > s.rows.length
        ? `(${s.rows.length} of ${s.num_rows_total} listed)` : `(${s.rows.length})`;
      const seen = new Set();
      s.rows.forEach((row, i) => {
        const key = row.request_id + "\u0000" + row.seq_index;
        seen.add(key);
        let tr = this.rowNodes.get(key);
        if (!tr) {
          tr = document.createElement("tr");
          tr.dataset.requestId = row.request_id;
          tr.dataset.seq = row.seq_index;
          tr.innerHTML = `<td class="id"><i></i><span></span></td><td class="seq"></td><td class="status"></td><td class="tokens"></td><td class="computed"></td><td class="preempted"></td><td class="table"><canvas></canvas></td>`;
          $("td.id i", tr).style.background = requestColor(row.request_id);
          $("td.id span", tr).textContent = row.request_id;
          $("td.id", tr).title = row.request_id;
          $("td.seq", tr).textContent = row.seq_index;
          const canvas = $("canvas", tr);
          canvas.addEventListener("mousemove", (ev) => this.rowTip(ev, tr));
          canvas.addEventListener("mouseleave", hideTip);
          this.rowNodes.set(key, tr);
        }
        tr.dataset.status = row.status;
        tr.dataset.index = i;
        $("td.status", tr).textContent = row.status;
        $("td.tokens", tr).textContent = `${row.num_prompt_tokens} + ${row.num_output_tokens}/${row.max_tokens}`;
        $("td.computed", tr).textContent = row.num_computed_tokens;
        $("td.preempted", tr).textContent = row.num_preemptions || "";
        if (tbody.children[i] !== tr) tbody.insertBefore(tr, tbody.children[i] || null);
        this.drawTable(tr, row);
      });
      for (const [key, tr] of this.rowNodes) {
        if (!seen.has(key)) {
          tr.remove();
          this.rowNodes.delete(key);
        }
      }
    }

    drawTable(tr, row) {
      const s = this.snap;
      const canvas = $("canvas", tr);
      const table = row.status === "swapped" ? row.swapped_blocks : row.block_table;
      const size = 10, step = 12;
      const width = Math.max(table.length * step, 1);
      canvas.style.width = Math.min(width, 4000) + "px";
      const [ctx] = scaleCanvas(canvas, 12);
      ctx.clearRect(0, 0, width, 12);
      table.forEach((b, logical) => {
        const x = logical * step;
        if (row.status === "swapped") {
          ctx.fillStyle = COLORS.swapped;
          ctx.fillRect(x, 1, size, size);
          return;
        }
        const shared = s.refs[b] > 1;
        const filled = Math.min(1, Math.max(0, row.num_computed_tokens - logical * s.block_size) / s.block_size);
        ctx.fillStyle = requestColor(row.request_id, shared ? 42 : 56);
        ctx.globalAlpha = 0.35;
        ctx.fillRect(x, 1, size, size);
        ctx.globalAlpha = 1;
        const h = Math.round(size * filled);
        ctx.fillRect(x, 1 + size - h, size, h);
        if (shared) {
          ctx.strokeStyle = "#fff";
          ctx.lineWidth = 1.5;
          ctx.strokeRect(x + 0.75, 1.75, size - 1.5, size - 1.5);
        }
      });
    }

    rowTip(ev, tr) {
      const s = this.snap;
      const row = s.rows[Number(tr.dataset.index)];
      if (!row) return hideTip();
      const r = ev.target.getBoundingClientRect();
      const logical = Math.floor((ev.clientX - r.left) / 12);
      const table = row.status === "swapped" ? row.swapped_blocks : row.block_table;
      if (logical < 0 || logical >= table.length) return hideTip();
      if (row.status === "swapped") return showTip(ev, `logical block ${logical} → host block ${table[logical]} (swapped out)`);
      showTip(ev, `logical block ${logical} → physical block ${table[logical]}\n` + this.describeBlock(table[logical]));
    }
  }

  // --- the history charts -----------------------------------------------------------

  const CHARTS = {
    // prompt tokens arrive in bursts far above the generation rate: they are only quoted
    throughput: { series: [["gen_tps", "generated tok/s", "#3ecf6e"]],
      now: (p) => `${fmt(p.gen_tps, 1)} generated · ${fmt(p.prompt_tps, 0)} prompt tok/s` },
    ttft: { series: [["ttft_ms", "TTFT ms", "#f0b429"]], now: (p) => latest("ttft_ms", 1) },
    itl: { series: [["itl_ms", "ITL ms", "#b07cf0"]], now: (p) => latest("itl_ms", 2) },
    requests: { series: [["running", "running", "#3ecf6e"], ["waiting", "waiting", "#f0b429"]], bars: ["preemptions", "#e5534b"],
      now: (p) => `${fmt(p.running)} run · ${fmt(p.waiting)} wait · ${fmt(p.preemptions_total)} preempted` },
  };

  // a latency mean exists only for seconds that had one: quote the latest there was
  function latest(field, digits) {
    for (let i = history.length - 1; i >= 0; i--) {
      if (history[i][field] !== null && history[i][field] !== undefined) return `${fmt(history[i][field], digits)} ms`;
    }
    return "–";
  }

  function drawCharts() {
    const now = Date.now() / 1000;
    const last = history[history.length - 1];
    for (const fig of document.querySelectorAll(".chart")) {
      const spec = CHARTS[fig.dataset.chart];
      $(".now", fig).textContent = last ? spec.now(last) : "";
      const [ctx, w, h] = scaleCanvas($("canvas", fig), 110);
      ctx.clearRect(0, 0, w, h);
      const left = 34, bottom = 14, plotW = w - left - 4, plotH = h - bottom - 4;
      const points = history.filter((p) => p.t >= now - HISTORY_S);
      let max = 0;
      for (const p of points) {
        for (const [field] of spec.series) if (p[field] !== null && p[field] > max) max = p[field];
        if (spec.bars && p[spec.bars[0]] > max) max = p[spec.bars[0]];
      }
      max = max > 0 ? niceMax(max) : 1;
      ctx.strokeStyle = "#2a3140";
      ctx.fillStyle = "#8a93a6";
      ctx.font = "10px system-ui";
      ctx.lineWidth = 1;
      for (let i = 0; i <= 2; i++) {
        const y = 4 + plotH - (plotH * i) / 2;
        ctx.beginPath();
        ctx.moveTo(left, y + 0.5);
        ctx.lineTo(left + plotW, y + 0.5);
        ctx.stroke();
        ctx.textAlign = "right";
        ctx.textBaseline = "middle";
        ctx.fillText(shortNum((max * i) / 2), left - 4, y);
      }
      ctx.textAlign = "left";
      ctx.textBaseline = "alphabetic";
      ctx.fillText(`−${HISTORY_S / 60} min`, left, h - 2);
      ctx.textAlign = "right";
      ctx.fillText("now", left + plotW, h - 2);
      const xOf = (t) => left + plotW * (1 - (now - t) / HISTORY_S);
      const yOf = (v) => 4 + plotH - (plotH * v) / max;
      if (spec.bars) {
        ctx.fillStyle = spec.bars[1];
        for (const p of points) if (p[spec.bars[0]] > 0) ctx.fillRect(xOf(p.t) - 1, yOf(p[spec.bars[0]]), 2, 4 + plotH - yOf(p[spec.bars[0]]));
      }
      for (const [field, , color] of spec.series) {
        ctx.strokeStyle = color;
        ctx.lineWidth = 1.5;
        ctx.beginPath();
        let pen = false;
        for (const p of points) {
          if (p[field] === null || p[field] === undefined) { pen = false; continue; }
          const x = xOf(p.t), y = yOf(p[field]);
          if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
          pen = true;
        }
        ctx.stroke();
      }
    }
  }

  function niceMax(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  function shortNum(v) {
    if (v >= 1e6) return fmt(v / 1e6, 1) + "M";
    if (v >= 1e4) return fmt(v / 1e3, 0) + "k";
    if (v >= 10) return fmt(v, 0);
    return fmt(v, v ? 1 : 0);
  }

  // --- the stream -------------------------------------------------------------------

  function onEvent(name, data) {
    const msg = JSON.parse(data);
    if (name === "hello") {
      blockStates = msg.block_states;
      history = msg.history;
      drawCharts();
      return;
    }
    if (name !== "update") return;
    for (const snap of msg.engines) {
      const key = snap.engine + "/" + snap.instance;
      if (!engines.has(key)) engines.set(key, new Panel(key));
      engines.get(key).update(snap);
    }
    for (const key of msg.gone) {
      const panel = engines.get(key);
      if (panel) panel.node.remove();
      engines.delete(key);
    }
    $("#no-engine").hidden = engines.size > 0;
    if (msg.points.length) {
      history = history.concat(msg.points).slice(-HISTORY_S * 2);
      drawCharts();
    }
    setStatus("live", engines.size ? `live · ${new Date().toLocaleTimeString()}` : "live · no engine reports yet");
  }

  async function connect() {
    if (controller) controller.abort();
    controller = new AbortController();
    const mine = controller;
    setStatus("connecting", "connecting…");
    try {
      const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
      const resp = await fetch(STREAM_URL, { headers, signal: mine.signal, cache: "no-store" });
      if (resp.status === 401) {
        setStatus("key", apiKey ? "wrong API key" : "API key needed");
        $("#keyform").hidden = false;
        $("#key").focus();
        return;
      }
      if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
      $("#keyform").hidden = true;
      retryMs = 500;
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          let name = "message", data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event: ")) name = line.slice(7);
            else if (line.startsWith("data: ")) data += line.slice(6);
          }
          if (data) onEvent(name, data);
        }
      }
      throw new Error("stream ended");
    } catch (err) {
      if (mine.signal.aborted) return;
      setStatus("error", `disconnected (${err.message}); retrying`);
      setTimeout(() => { if (controller === mine && !document.hidden) connect(); }, retryMs);
      retryMs = Math.min(retryMs * 2, 5000);
    }
  }

  $("#keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("#key").value.trim();
    sessionStorage.setItem("pagedserve-key", apiKey);
    connect();
  });

  // A hidden tab closes its stream: the gateway then stops asking the scheduler for snapshots.
  document.addEventListener("visibilitychange", () => {
    if (document.hidden) {
      if (controller) controller.abort();
      controller = null;
      setStatus("connecting", "paused while hidden");
    } else {
      connect();
    }
  });
  window.addEventListener("hashchange", () => {
    const key = keyFromFragment();
    if (key && key !== apiKey) {
      apiKey = key;
      sessionStorage.setItem("pagedserve-key", apiKey);
      connect();
    }
  });
  window.addEventListener("resize", () => { for (const p of engines.values()) p.render(); drawCharts(); });
  setInterval(drawCharts, 2000); // the time axis moves on between points

  // For scripts and tests: where a block's cell is on screen, and what the page holds.
  window.pagedserveDashboard = {
    engines,
    cellCenter(block, engineIndex = 0) {
      const panel = [...engines.values()][engineIndex];
      return panel ? panel.pool.center(block) : null;
    },
  };

  if (apiKey) sessionStorage.setItem("pagedserve-key", apiKey);
  if (!document.hidden) connect();
})();
