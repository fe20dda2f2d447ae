// Tandem's dashboard: one event stream (/ui/events) for models, memory, charts and requests,
// the admin endpoints for the buttons, and the public /v1/chat/completions for the playground.
// No library, no inline script (the page is served under a strict Content-Security-Policy).
// With an api_key set, the key typed into the header form is kept in this tab's
// sessionStorage and sent as "Authorization: Bearer"; the event stream is read with fetch,
// not EventSource, so that header can go with it.
'use strict';

const $ = (sel) => document.querySelector(sel);
const WINDOW_S = 15 * 60;
const PALETTE = ['#2563eb', '#dc2626', '#16a34a', '#9333ea', '#ea580c', '#0891b2', '#ca8a04', '#db2777'];
const KEY = 'tandem-api-key';

const state = { samples: [], overview: null, colors: {}, models: [] };

function authHeaders(json) {
  const h = {};
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = 'Bearer ' + key;
  if (json) h['Content-Type'] = 'application/json';
  return h;
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') node.className = v;
    else if (k.startsWith('data-')) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}

function colorOf(name) {
  if (!state.colors[name]) state.colors[name] = PALETTE[Object.keys(state.colors).length % PALETTE.length];
  return state.colors[name];
}

function fmt(v, digits = 1) { return v === null || v === undefined ? '–' : Number(v).toFixed(digits); }
function mb(v) { return v >= 1024 ? (v / 1024).toFixed(2) + ' GB' : Math.round(v) + ' MB'; }

async function errorText(r) {
  try { const body = await r.json(); return (body.error && body.error.message) || r.statusText; }
  catch (_) { return r.status + ' ' + r.statusText; }
}

// ---- the key --------------------------------------------------------------------------------

function askForKey(message) {
  $('#keyform').classList.remove('hidden');
  setStatus(message, 'bad');
}

$('#keyform').addEventListener('submit', (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, $('#key').value.trim());
  $('#keyform').classList.add('hidden');
  connect();
});

function setStatus(text, kind) {
  const s = $('#status');
  s.textContent = text;
  s.className = 'pill ' + (kind || '');
}

// ---- server-sent events over fetch ---------------------------------------------------------------

async function* readEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = 'message';
      const data = [];
      for (const line of frame.split('\n')) {
        if (line.startsWith('event:')) name = line.slice(6).trim();
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
      }
      if (data.length) yield { name, data: data.join('\n') };
    }
  }
}

let stream = null;

async function connect() {
  if (stream) stream.abort();
  const ctl = new AbortController();
  stream = ctl;
  while (stream === ctl) {
    try {
      const r = await fetch('/ui/events', { headers: authHeaders(false), signal: ctl.signal });
      if (r.status === 401) { askForKey('API key needed'); return; }
      if (!r.ok) throw new Error(await errorText(r));
      setStatus('live', 'ok');
      for await (const ev of readEvents(r)) onEvent(ev.name, JSON.parse(ev.data));
    } catch (err) {
      if (ctl.signal.aborted) return;
      setStatus('disconnected: ' + err.message, 'bad');
    }
    await new Promise((res) => setTimeout(res, 2000));
  }
}

function onEvent(name, body) {
  if (name === 'history') state.samples = body.samples;
  else if (body.sample) state.samples.push(body.sample);
  const cutoff = Date.now() / 1000 - WINDOW_S;
  while (state.samples.length && state.samples[0].t < cutoff) state.samples.shift();
  if (body.overview) renderOverview(body.overview);
  if (body.requests) renderRequests(body.requests);
  renderCharts();
}

// ---- models -----------------------------------------------------------------------------------------

function renderOverview(view) {
  state.overview = view;
  setStatus(view.alive ? 'live' : 'engine down', view.alive ? 'ok' : 'bad');
  $('#memory').textContent = `memory ${mb(view.used_mb)} of ${mb(view.limit_mb)} budget · MLX active ` +
    `${mb(view.mlx.active_mb || 0)}`;
  const body = $('#models tbody');
  body.replaceChildren(...view.models.map(modelRow));
  renderModelChoices(view.models);
  renderDistributed(view.distributed);
}

// "loading weights 40% of 96 MB", "converting GGUF (weights) 12%", or the phase alone.
function progressText(p) {
  if (!p.total) return p.phase;
  const pct = Math.round((100 * Math.min(p.done, p.total)) / p.total) + '%';
  return p.unit === 'bytes' ? `${p.phase} ${pct} of ${mb(p.total / 1048576)}` : `${p.phase} ${pct}`;
}

function stateCell(m) {
  let text = m.state;
  if (text === 'unloaded') text = m.on_disk === false ? 'not downloaded' : m.on_disk ? 'on disk' : 'unloaded';
  const cell = el('td', { class: 'state state-' + m.state, title: m.error || '' }, text, m.error ? ' ⚠' : '');
  if (m.state === 'loading' && m.progress) {
    const line = el('span', { class: 'progress' }, progressText(m.progress));
    if (m.progress.total) {
      const bar = el('span', { class: 'bar' }, el('span'));
      bar.firstChild.style.width = ((100 * Math.min(m.progress.done, m.progress.total)) / m.progress.total).toFixed(0) + '%';
      line.append(bar);
    }
    cell.append(line);
  }
  return cell;
}

function modelRow(m) {
  const kvShare = m.kv_budget_mb ? Math.min(1, m.kv_used_mb / m.kv_budget_mb) : 0;
  const bar = el('span', { class: 'bar' }, el('span'));
  bar.firstChild.style.width = (kvShare * 100).toFixed(0) + '%';
  const tiers = Object.entries(m.cache_tiers || {}).map(([tier, t]) =>
    `${tier} ${mb(t.bytes / 1048576)}, ${t.entries} entries, ${t.hits} hits`).join(' · ');
  const actions = el('td', { class: 'actions' });
  if (m.public) {
    const busy = m.state === 'loading' || m.state === 'unloading';
    actions.append(
      el('button', { 'data-action': 'load', disabled: busy || m.state === 'loaded', onclick: () => act('load', m.name) }, 'Load'),
      el('button', { 'data-action': 'unload', disabled: busy || m.state !== 'loaded' || m.pinned,
        onclick: () => act('unload', m.name) }, 'Unload'),
      el('button', { 'data-action': 'pin', onclick: () => act('pin', m.name, { pinned: !m.pinned }) },
        m.pinned ? 'Unpin' : 'Pin'));
  }
  return el('tr', { 'data-model': m.name },
    el('td', {}, m.name, m.default ? el('span', { class: 'muted' }, ' (default)') : null),
    el('td', {}, m.role),
    stateCell(m),
    el('td', { class: 'num' }, m.weights_mb ? mb(m.weights_mb) : '–'),
    el('td', { class: 'num' }, m.kv_budget_mb ? `${mb(m.kv_used_mb)} / ${mb(m.kv_budget_mb)}` : '–', m.kv_budget_mb ? bar : null),
    el('td', { class: 'tiers' }, tiers || '–'),
    el('td', { class: 'num running' }, m.running),
    el('td', { class: 'num' }, m.waiting),
    el('td', { class: 'num' }, m.idle_s === null ? '–' : fmt(m.idle_s, 0) + ' s'),
    el('td', { class: 'pinned' }, m.pinned ? 'yes' : 'no'),
    actions);
}

async function act(action, model, extra) {
  const msg = $('#action-error');
  msg.classList.add('hidden');
  try {
    const r = await fetch('/v1/admin/models/' + action, {
      method: 'POST', headers: authHeaders(true), body: JSON.stringify({ model, ...(extra || {}) }) });
    if (r.status === 401) { askForKey('API key needed'); return; }
    if (!r.ok) throw new Error(await errorText(r));
    const row = await r.json();
    if (state.overview) {
      state.overview.models = state.overview.models.map((m) => (m.name === row.name ? row : m));
      renderOverview(state.overview);
    }
  } catch (err) {
    msg.textContent = `${action} ${model}: ${err.message}`;
    msg.classList.remove('hidden');
  }
}

// ---- charts -------------------------------------------------------------------------------------------

function series(pick) {
  // pick(sample) -> {name: value}; one line per name.
  const out = {};
  for (const s of state.samples) {
    for (const [name, v] of Object.entries(pick(s) || {})) {
      if (v === null || v === undefined) continue;
      (out[name] = out[name] || []).push([s.t, v]);
    }
  }
  return Object.entries(out).map(([name, points]) => ({ name, points }));
}

function perModel(field) {
  return (s) => Object.fromEntries(Object.entries(s.models || {}).map(([n, m]) => [n, m[field]]));
}

function drawChart(canvas, lines, opts) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== w * dpr || canvas.height !== h * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
  const g = canvas.getContext('2d');
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const styles = getComputedStyle(document.documentElement);
  const muted = styles.getPropertyValue('--muted').trim(), line = styles.getPropertyValue('--line').trim();
  const now = Date.now() / 1000, t0 = now - WINDOW_S;
  let max = opts.max || 0;
  for (const l of lines) for (const [, v] of l.points) max = Math.max(max, v);
  max = max > 0 ? max * 1.1 : 1;
  const left = 40, bottom = h - 16, top = 6, right = w - 6;
  const x = (t) => left + ((t - t0) / WINDOW_S) * (right - left);
  const y = (v) => bottom - (v / max) * (bottom - top);
  g.strokeStyle = line; g.fillStyle = muted; g.font = '11px system-ui'; g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = (max * i) / 4;
    g.beginPath(); g.moveTo(left, y(v)); g.lineTo(right, y(v)); g.stroke();
    g.fillText(v >= 100 ? v.toFixed(0) : v.toFixed(v >= 10 ? 1 : 2), 2, y(v) + 4);
  }
  for (const m of [15, 10, 5, 0]) g.fillText(m ? `-${m}m` : 'now', x(now - m * 60) - (m ? 8 : 22), h - 3);
  for (const l of lines) {
    g.strokeStyle = l.color || colorOf(l.name); g.fillStyle = g.strokeStyle; g.lineWidth = 1.5;
    g.beginPath();
    l.points.forEach(([t, v], i) => (i ? g.lineTo(x(t), y(v)) : g.moveTo(x(t), y(v))));
    g.stroke();
    if (l.points.length < 40) for (const [t, v] of l.points) { g.beginPath(); g.arc(x(t), y(v), 2, 0, 7); g.fill(); }
  }
}

function renderCharts() {
  drawChart($('#chart-toks'), series(perModel('tok_s')), {});
  drawChart($('#chart-ttft'), series(perModel('ttft_s')), {});
  drawChart($('#chart-queue'), series((s) => ({ running: s.running, queued: s.queued }))
    .map((l) => ({ ...l, color: l.name === 'running' ? PALETTE[2] : PALETTE[4] })), {});
  // The budget is drawn when it is near what is used; far above it (75% of the machine by
  // default), it would flatten the lines to nothing, and the caption gives it instead.
  const memory = series((s) => ({ 'budget used': s.used_mb, 'MLX active': s.mlx_active_mb }));
  const peak = Math.max(0, ...memory.flatMap((l) => l.points.map((p) => p[1])));
  const limit = state.samples.length ? state.samples[state.samples.length - 1].limit_mb : 0;
  if (limit && limit <= 3 * peak) memory.push(...series((s) => ({ limit: s.limit_mb })));
  $('#memory-budget').textContent = limit ? `budget ${mb(limit)}${limit > 3 * peak ? ', off the scale' : ''}` : '';
  drawChart($('#chart-memory'), memory.map((l) =>
    ({ ...l, color: { 'budget used': PALETTE[0], 'MLX active': PALETTE[3], limit: PALETTE[1] }[l.name] })), {});
  drawChart($('#chart-hits'), series((s) => ({ 'hit rate': s.hit_rate })).map((l) => ({ ...l, color: PALETTE[5] })), { max: 1 });
  drawChart($('#chart-spec'), series(perModel('acceptance')), { max: 1 });
  const names = Object.keys(state.colors);
  $('#legend').replaceChildren(...names.map((n) => {
    const swatch = el('i');
    swatch.style.background = state.colors[n];
    return el('span', {}, swatch, n);
  }), el('span', { class: 'muted' }, 'queue: green running, orange queued · memory: blue used, purple MLX active, red limit'));
}

window.addEventListener('resize', renderCharts);

// ---- requests ------------------------------------------------------------------------------------------

function renderRequests(rows) {
  // The row's tooltip: the server's request id, and the client's own beside it when it sent one.
  const ids = (r) => r.id + (r.client_request_id ? ` (client's id: ${r.client_request_id})` : '');
  $('#requests tbody').replaceChildren(...rows.map((r) => el('tr', { title: ids(r) },
    el('td', {}, new Date(r.time * 1000).toLocaleTimeString()),
    el('td', {}, r.model || '–'),
    el('td', {}, `${r.method} ${r.route}`),
    el('td', {}, r.client || '–'),
    el('td', { class: 'num' }, r.prompt_tokens),
    el('td', { class: 'num' }, r.cached_tokens),
    el('td', { class: 'num' }, r.completion_tokens),
    el('td', { class: 'num' }, r.ttft_s === null ? '–' : fmt(r.ttft_s, 2) + ' s'),
    el('td', { class: 'num' }, r.duration_s === null ? '–' : fmt(r.duration_s, 2) + ' s'),
    el('td', { class: r.status >= 400 ? 'error' : '' }, r.status === null ? '…' : r.status,
      r.outcome && r.outcome !== 'stop' ? ` (${r.outcome})` : ''))));
}

// ---- distributed ----------------------------------------------------------------------------------------

function renderDistributed(d) {
  const panel = $('#distributed-panel');
  if (!d) { panel.classList.add('hidden'); return; }
  panel.classList.remove('hidden');
  $('#distributed-launch').textContent = `${d.world_size} ranks, ${d.backend} backend, ${d.mode} parallel` +
    (d.error ? ` · stopped: ${d.error}` : '');
  $('#distributed-launch').className = d.error ? 'error' : 'muted';
  $('#distributed tbody').replaceChildren(...(d.ranks || []).map((r) => el('tr', { 'data-rank': r.rank },
    el('td', { class: 'num' }, r.rank),
    el('td', {}, r.host || '–'),
    el('td', {}, r.address || '–'),
    el('td', { class: 'rank-state rank-' + r.state, title: r.error || '' }, r.state, r.error ? ': ' + r.error : ''),
    el('td', { class: 'num' }, r.rank === 0 ? 'serves HTTP' : fmt(r.last_heard_s, 1) + ' s ago'),
    el('td', { class: 'num' }, r.ping_ms === null ? '–' : fmt(r.ping_ms, 1) + ' ms'))));
}

// ---- playground ------------------------------------------------------------------------------------------

const chat = { messages: [], image: null, ctl: null };

function renderModelChoices(models) {
  const select = $('#pg-model');
  const chatModels = models.filter((m) => m.role === 'chat').map((m) => m.name);
  const current = select.value;
  if ([...select.options].map((o) => o.value).join() === chatModels.join()) return;
  select.replaceChildren(...chatModels.map((n) => el('option', { value: n }, n)));
  const fallback = (models.find((m) => m.default) || {}).name;
  select.value = chatModels.includes(current) ? current : fallback || chatModels[0] || '';
}

$('#pg-image').addEventListener('change', () => {
  const file = $('#pg-image').files[0];
  if (!file) { chat.image = null; return; }
  const reader = new FileReader();
  reader.onload = () => { chat.image = reader.result; };
  reader.readAsDataURL(file);
});

$('#pg-clear').addEventListener('click', () => { chat.messages = []; $('#pg-log').replaceChildren(); });
$('#pg-input').addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) { e.preventDefault(); $('#playground').requestSubmit(); }
});
$('#pg-stop').addEventListener('click', () => chat.ctl && chat.ctl.abort());

$('#playground').addEventListener('submit', async (e) => {
  e.preventDefault();
  const text = $('#pg-input').value.trim();
  if (!text || chat.ctl) return;
  const content = chat.image
    ? [{ type: 'text', text }, { type: 'image_url', image_url: { url: chat.image } }]
    : text;
  const userBox = el('div', { class: 'msg user' }, el('span', { class: 'who' }, 'you'), text);
  if (chat.image) userBox.append(el('img', { src: chat.image, alt: 'attached image' }));
  const reasoning = el('div', { class: 'reasoning hidden' });
  const answer = el('div', { class: 'answer' });
  const tools = el('div', { class: 'tools hidden' });
  const meta = el('div', { class: 'meta' });
  const model = $('#pg-model').value;
  const box = el('div', { class: 'msg assistant' }, el('span', { class: 'who' }, model), reasoning, answer, tools, meta);
  $('#pg-log').append(userBox, box);
  $('#pg-input').value = '';
  $('#pg-image').value = '';
  chat.image = null;
  chat.messages.push({ role: 'user', content });
  const body = { model, messages: chat.messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($('#pg-temperature').value), max_tokens: Number($('#pg-max-tokens').value) };
  if ($('#pg-effort').value) body.reasoning_effort = $('#pg-effort').value;
  chat.ctl = new AbortController();
  $('#pg-send').disabled = true; $('#pg-stop').disabled = false;
  const calls = [];
  const started = performance.now();
  let first = null;
  try {
    const r = await fetch('/v1/chat/completions', { method: 'POST', headers: authHeaders(true),
      body: JSON.stringify(body), signal: chat.ctl.signal });
    if (r.status === 401) askForKey('API key needed');
    if (!r.ok) throw new Error(await errorText(r));
    for await (const ev of readEvents(r)) {
      if (ev.data === '[DONE]') break;
      const chunk = JSON.parse(ev.data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) meta.textContent = `${chunk.usage.prompt_tokens} tokens in · ${chunk.usage.completion_tokens} out`;
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      const think = delta.reasoning_content || delta.reasoning;
      if (first === null && (think || delta.content || delta.tool_calls)) first = performance.now();
      if (think) { reasoning.classList.remove('hidden'); reasoning.textContent += think; }
      if (delta.content) answer.textContent += delta.content;
      for (const call of delta.tool_calls || []) {
        const c = (calls[call.index] = calls[call.index] || { name: '', arguments: '' });
        if (call.function && call.function.name) c.name += call.function.name;
        if (call.function && call.function.arguments) c.arguments += call.function.arguments;
        tools.classList.remove('hidden');
        tools.textContent = calls.map((x) => `${x.name}(${x.arguments})`).join('\n');
      }
      $('#pg-log').scrollTop = $('#pg-log').scrollHeight;
    }
    chat.messages.push({ role: 'assistant', content: answer.textContent });
  } catch (err) {
    if (!chat.ctl.signal.aborted) answer.append(el('span', { class: 'error' }, ' ' + err.message));
    chat.messages.pop();
  } finally {
    const secs = (performance.now() - started) / 1000;
    meta.textContent += (meta.textContent ? ' · ' : '') +
      (first !== null ? `first token ${((first - started) / 1000).toFixed(2)} s · ` : '') + `${secs.toFixed(2)} s`;
    box.classList.add('done');
    chat.ctl = null;
    $('#pg-send').disabled = false; $('#pg-stop').disabled = true;
  }
});

connect();
