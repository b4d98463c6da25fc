'use strict';
// The web view: each page is drawn from /admin/api/*. Data only ever becomes text.
const main = document.getElementById('main');
const full = document.body.dataset.mode === 'full';

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (key === 'onclick') node.addEventListener('click', value);
    else if (key === 'className') node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}
// A part a page leaves out is null: left out here too (replaceChildren would write "null").
function show(...nodes) { main.replaceChildren(...nodes.filter((node) => node !== null)); }
// An empty table says "none" under its header, rather than showing a header alone.
function table(headers, rows) {
  const body = rows.length ? rows.map((row) => el('tr', {}, ...row.map((cell) => el('td', {}, cell))))
    : [el('tr', {className: 'none'}, el('td', {colspan: String(headers.length)}, 'none'))];
  return el('table', {}, el('tr', {}, ...headers.map((h) => el('th', {}, h))), ...body);
}
function appLink(id) { return el('a', {href: '/admin/apps/' + encodeURIComponent(id)}, id); }
function when(value) { return value === null || value === undefined ? '-' : String(value); }
// A time as how long ago (or how soon) it is, the exact UTC time on hover: a table's
// column stays narrow, and a time never breaks in the middle of its digits.
function ago(iso) {
  if (iso === null || iso === undefined) return '-';
  const at = Date.parse(iso);
  if (Number.isNaN(at)) return String(iso);
  const seconds = Math.round((Date.now() - at) / 1000);
  const span = Math.abs(seconds);
  const text = span < 90 ? `${span} s` : span < 5400 ? `${Math.round(span / 60)} min` :
    span < 129600 ? `${Math.round(span / 3600)} h` : `${Math.round(span / 86400)} days`;
  const exact = new Date(at).toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
  return el('time', {datetime: iso, title: exact}, seconds < 0 ? `in ${text}` : `${text} ago`);
}
// The server's "why" as a sentence of its own: a capital first, a full stop last.
function sentence(text) {
  const s = String(text);
  return s.charAt(0).toUpperCase() + s.slice(1) + (/[.!?]$/.test(s) ? '' : '.');
}
// A result's source: what the analysis named, or, when it named none, stored as "legacy"
// (the old server's word, kept for its readers), said in words with the stored value on
// hover.
function source(value) {
  return value === 'legacy' ? el('span', {title: 'stored as "legacy": the result named no' +
    ' analysis_source'}, 'not named by the analyser') : when(value);
}

async function api(path, body) {
  const init = {credentials: 'same-origin', headers: {}};
  if (body !== undefined) {
    init.method = 'POST';
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const answer = await fetch(path, init);
  if (answer.status === 401) { location.assign('/admin/login'); throw new Error('signed out'); }
  const data = await answer.json();
  if (!answer.ok) throw new Error(data.detail || ('HTTP ' + answer.status));
  return data;
}
function failed(error) { show(el('p', {className: 'error'}, error.message)); }

// An action: asks once, says what it did.
async function act(question, path, body, done) {
  if (!confirm(question)) return;
  const out = document.getElementById('outcome');
  try { done(await api(path, body)); } catch (error) {
    out.replaceChildren(el('p', {className: 'error'}, error.message));
  }
}
function said(text) {
  const out = document.getElementById('outcome');  // gone if the page was drawn as an error
  if (out) out.replaceChildren(el('p', {}, text));
}
function refetched(result) {
  const o = result.outcomes;
  return `${result.selected} selected: ${o.queued} queued now, ${o.waiting} waiting for` +
    ` a lease to end, ${o.lease_broken} with the lease broken, ${o.skipped} left as they were.`;
}

// The queue's pause as an action answered it, and when: newer than a count made before it
// (the overview's figures are counted at most once a minute), so shown instead of it.
let pauseAnswered = null;
function pauseOf(s, counted) {
  if (pauseAnswered !== null && Date.parse(counted) < pauseAnswered.at) return pauseAnswered.pause;
  const p = s.paused || {};
  return {paused: Boolean(p.paused), at: p.paused_at, by: p.paused_by, reason: p.reason};
}
function pauseAnswer(result) {
  pauseAnswered = {at: Date.now(), pause: {paused: result.paused, at: result.pausedAt,
    by: result.pausedBy, reason: result.reason}};
  const text = {paused: 'The queue is paused.', resumed: 'The queue is resumed.',
    unchanged: result.paused ? 'The queue was paused already.' : 'The queue was not paused.'};
  route().then(() => said(text[result.outcome] || result.outcome));
}
function queuePause(pause) {
  if (pause.paused) {
    return el('div', {className: 'banner', id: 'queue-paused'},
      el('strong', {}, 'The queue is paused: no app is handed out until it is resumed. '),
      'Since ', ago(pause.at), `, by ${when(pause.by)}. `,
      pause.reason ? `Reason: ${pause.reason}` : 'No reason given.',
      full ? ' ' : null,
      full ? el('button', {type: 'button', onclick: () => act('Resume the queue? Analysers' +
        ' are handed apps again at once.', '/admin/api/queue/resume', {}, pauseAnswer)},
      'Resume the queue') : null);
  }
  if (!full) return null;
  const reason = el('input', {name: 'reason', size: 40, maxlength: 500});
  const form = el('form', {id: 'pause-queue'}, el('label', {}, 'Reason (optional) ', reason),
    ' ', el('button', {type: 'submit'}, 'Pause the queue'));
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    act('Pause the whole queue? No analyser is handed an app until it is resumed.' +
      (reason.value ? ` Reason: ${reason.value}` : ''), '/admin/api/queue/pause',
    reason.value ? {reason: reason.value} : {}, pauseAnswer);
  });
  return form;
}
// The queue-status document's keys in words, each key on hover (its title) for whoever
// reads `queue-status --json` beside the page (docs/monitoring.md says what each counts).
const WORDS = {
  lease_expired_failures: 'failed: leases ended without a result',
  abandoned_leases: 'last leases abandoned', outdated_settling: 'old-version results settling',
  refetch_waiting: 'refetches waiting for a lease', analysis_version: 'analysis version',
  stale_days: 'stale after (days)', processing_timeout_minutes: 'lease (minutes)',
  max_lease_attempts: 'leases before backing off', retry_backoff: 'retry back-off'};
function keyed(key) { return el('span', {title: key}, WORDS[key] || key); }
// A document's part as one row under its keys in words, but the keys another table shows.
function keyedRow(part, shownElsewhere) {
  const keys = Object.keys(part).filter((k) => !shownElsewhere.includes(k));
  return table(keys.map(keyed), [keys.map((k) => part[k])]);
}
const IN_RETRIES_AND_HOLDS = ['retries_next_hour', 'retries_waiting', 'retries_exhausted',
  'held_apps'];
function ratio(value) { return value === null || value === undefined ? 'no results' :
  `${Math.round(value * 1000) / 10} %`; }

// The queue over time: uPlot's charts (web/vendor/, served by the service itself), drawn
// anew with the overview; a sum under each says what it shows, in words a test can read.
let charts = [];
// The fleet's results green, failures red, expired leases orange; the analysers' lines
// in other colours, so no colour means two things on one page.
const FLEET_COLOURS = ['#2a6', '#c33', '#e90', '#36c'];
const ANALYSER_COLOURS = ['#36c', '#939', '#0aa', '#a63', '#555', '#c6c', '#06a', '#990'];
function chart(id, title, history, series, yLabel, points = false, colours = FLEET_COLOURS) {
  const box = el('div', {className: 'chart', id});
  const width = Math.max(280, Math.min(main.clientWidth - 40, 900));
  const x = history.hours.map((hour) => Date.parse(hour) / 1000);
  const options = {title, width, height: 200, scales: {x: {time: true}},
    axes: [{values: (u, ticks) => ticks.map(hourLabel)}, {label: yLabel, size: 50}],
    series: [{label: 'hour (your time)'}, ...series.map((line, index) => ({label: line.label,
      stroke: colours[index % colours.length], width: 1.5, spanGaps: false,
      points: points ? {show: true, size: 5} : {}}))]};
  charts.push(new uPlot(options, [x, ...series.map((line) => line.values)], box));
  return box;
}
// An axis tick: the day where one begins (in the reader's locale), else the hour.
function hourLabel(seconds) {
  const at = new Date(seconds * 1000);
  return at.getHours() === 0 ? at.toLocaleDateString(undefined, {month: 'short', day: 'numeric'})
    : `${String(at.getHours()).padStart(2, '0')}:00`;
}
function total(values) { return values.reduce((sum, v) => sum + (v || 0), 0); }
function lastCounted(values) {
  for (let i = values.length - 1; i >= 0; i -= 1) if (values[i] !== null) return values[i];
  return null;
}
function queueOverTime(history) {
  for (const old of charts) old.destroy();
  charts = [];
  const span = history.window === '24h' ? 'the last 24 hours' : 'the last 7 days';
  const other = history.window === '24h' ? '7d' : '24h';
  const switcher = el('a', {href: '/admin?window=' + other, id: 'history-window'},
    other === '24h' ? 'Show the last 24 hours' : 'Show the last 7 days');
  const named = history.analysers.map((a) => a.name === null ? 'shared password' : a.name);
  const counted = history.backlog.filter((b) => b !== null).length;
  return el('section', {id: 'history'},
    el('h2', {}, `The queue over time: ${span}`), el('p', {}, switcher),
    chart('chart-results', 'Results and failures per hour', history, [
      {label: 'results', values: history.results}, {label: 'failures', values: history.failures},
      {label: 'leases expired', values: history.expiredLeases}], 'per hour'),
    el('p', {className: 'note', id: 'results-sum'}, `In ${span}, results:` +
      ` ${total(history.results)}, failures: ${total(history.failures)}, leases expired:` +
      ` ${total(history.expiredLeases)} (from the history of results).`),
    chart('chart-backlog', 'The backlog and the apps by state', history, [
      {label: 'backlog', values: history.backlog},
      ...['queued', 'processing', 'failed'].map((state) => ({label: state,
        values: history.states.map((s) => (s === null ? null : s[state] || 0))}))], 'apps',
      true),
    el('p', {className: 'note', id: 'backlog-sum'}, ...counted ? [
      `Counted by the hourly report in ${counted} of ${history.hours.length} hours; last `,
      ago(history.lastSnapshot), `, the backlog: ${lastCounted(history.backlog)}, queued:` +
      ` ${lastCounted(history.states.map((s) => (s === null ? null : s.queued || 0)))}.`] :
      ['No hourly report has counted the queue in this window yet (the scheduled report, or' +
      ' serve, keeps one count an hour).']),
    chart('chart-analyser-results', 'Each analyser\'s results per hour', history,
      history.analysers.map((a, i) => ({label: named[i], values: a.results})), 'results',
      false, ANALYSER_COLOURS),
    chart('chart-analyser-failures', 'Each analyser\'s failures per hour', history,
      history.analysers.map((a, i) => ({label: named[i], values: a.failures})), 'failures',
      false, ANALYSER_COLOURS),
    el('div', {id: 'analyser-sums'}, table(['analyser', `results in ${span}`,
      `failures in ${span}`], history.analysers.map((a, i) => [named[i], total(a.results),
      total(a.failures)]))));
}

async function overview() {
  const shown = new URLSearchParams(location.search).get('window') === '24h' ? '24h' : '7d';
  const [data, record, fleet, history] = await Promise.all([api('/admin/api/status'),
    api('/admin/api/actions'), api('/admin/api/analysers'),
    api('/admin/api/history?window=' + shown)]);
  const busy = fleet.analysers.filter((a) => a.holding !== null || a.paused || a.broken);
  // Read now, as "Busy now" is: a pause or a resume shows at once, not a minute later.
  const live = fleet.analysers.filter((a) => !a.revoked);
  const broken = live.filter((a) => a.broken).length;
  const pausedNow = live.filter((a) => a.paused).length;
  const s = data.status;
  const h = s.held_back;
  show(el('h1', {}, 'Overview'), queuePause(pauseOf(s, data.counted)),
    el('div', {id: 'outcome'}),
    el('p', {className: 'note', id: 'counted'}, 'Counted ', ago(data.counted), '.'),
    broken ? el('p', {className: 'warn', id: 'broken-analysers'},
      broken === 1 ? 'A named analyser looks broken: ' : `${broken} named analysers look broken: `,
      el('a', {href: '/admin/analysers'}, 'see the analysers'), '.') : null,
    el('h2', {}, 'Apps by state'),
    table(['state', 'apps'], Object.entries(s.counts).map(([k, v]) =>
      [el('a', {href: '/admin/apps?state=' + k}, k), v])),
    el('h2', {}, 'Failures by reason'),
    table(['reason', 'apps'], s.failed_by_reason.map((r) =>
      [el('a', {href: '/admin/apps?state=failed&reason=' + encodeURIComponent(r.reason)},
        r.reason), r.apps])),
    el('h2', {}, 'Backlog'),
    table(['backlog', el('span', {title: 'to drain the backlog at the last 24 hours\' pace'},
      'ETA (hours)'), 'analysers in the last hour'],
      [[s.backlog_total, when(s.eta_hours), s.analysers_last_hour]]),
    queueOverTime(history),
    el('h2', {}, 'Busy now, paused or failing'),
    table(['analyser', 'holds', 'since', 'lease ends', 'paused', 'broken'], busy.map((a) => [
      a.name, a.holding ? appLink(a.holding.appId) : '-', ago(a.holding && a.holding.since),
      ago(a.holding && a.holding.until), a.paused ? 'paused' : 'no', a.broken ? 'broken' : 'no'])),
    el('h2', {}, 'Analysers'),
    table(['look broken', 'paused', 'failures in the last hour (the fleet)'],
      [[el('a', {href: '/admin/analysers'}, String(broken)),
        el('a', {href: '/admin/analysers'}, String(pausedNow)),
        ratio(s.failure_ratio_1h)]]),
    el('h2', {}, 'Retries and holds'),
    table(['retries due', 'retries due in the next hour', 'retries waiting', 'retries exhausted',
      'apps held'], [[s.backlog.retry_due, h.retries_next_hour, h.retries_waiting,
      h.retries_exhausted, h.held_apps]]),
    el('h2', {}, 'Next up, in claim order'),
    table(['bundle ID', 'popularity', 'added', 'why'], s.top_backlog.map((a) =>
      [appLink(a.appid), when(a.popularity), ago(a.added), a.reason])),
    el('h2', {}, 'Held back'), keyedRow(s.held_back, IN_RETRIES_AND_HOLDS),
    el('h2', {}, 'Policy in force'), keyedRow(s.policy, []),
    el('h2', {}, 'Recent operator actions'), actionsTable(record.actions.slice(0, 20)),
    el('p', {}, el('a', {href: '/admin/actions', id: 'all-actions'}, 'Every action, paged')));
}
function actionsTable(actions) {
  return table(['when', 'who', 'from', 'what', 'app', 'analyser', 'outcome'],
    actions.map((x) => [ago(x.at), x.actor, x.source, x.action,
      x.appId === null ? '-' : appLink(x.appId), when(x.analyser), when(x.outcome)]));
}
// Who did what, 50 a page, newest first; `before` in the address, so a page can be kept.
async function actions() {
  const query = new URLSearchParams(location.search);
  const before = query.get('before');
  const data = await api('/admin/api/actions' + (before ? '?before=' + encodeURIComponent(before)
    : ''));
  show(el('h1', {}, 'Operator actions'), actionsTable(data.actions),
    data.next !== null ? el('a', {href: '/admin/actions?before=' + data.next, id: 'older'},
      'Older actions') : null);
}

function appsAddress(filters) {
  const given = new URLSearchParams();
  for (const [name, value] of Object.entries(filters)) if (value) given.set(name, value);
  return '/admin/apps' + (String(given) ? '?' + given : '');
}
async function apps() {
  const query = new URLSearchParams(location.search);
  const data = await api('/admin/api/apps?' + query);
  const field = (name, label) => el('label', {}, label + ' ',
    el('input', {name, value: query.get(name) || '', size: 24}));
  const state = el('select', {name: 'state'}, el('option', {value: ''}, 'any state'),
    ...['queued', 'processing', 'analysed', 'failed'].map((s) => {
      const option = el('option', {value: s}, s);
      if (query.get('state') === s) option.setAttribute('selected', '');
      return option;
    }));
  // The failure reasons the server knows, as a list (no free text to mistype).
  const reason = el('select', {name: 'reason'}, el('option', {value: ''}, 'any reason'),
    ...data.reasons.map((r) => {
      const option = el('option', {value: r}, r);
      if (query.get('reason') === r) option.setAttribute('selected', '');
      return option;
    }));
  const filters = el('form', {className: 'filters', method: 'get', action: '/admin/apps'},
    el('label', {}, 'State ', state), el('label', {}, 'Failure reason ', reason),
    field('q', 'Bundle ID starts with'), field('has', 'Bundle ID contains'),
    el('button', {type: 'submit'}, 'Filter'));
  // The address holds the filters given, not the empty ones (a bookmark reads as asked).
  filters.addEventListener('submit', (event) => {
    event.preventDefault();
    location.assign(appsAddress(Object.fromEntries(new FormData(filters))));
  });
  const rows = data.apps.map((a) => [appLink(a.appId), a.status, when(a.failure),
    when(a.analysisVersion), ago(a.analysed), when(a.claimedBy)]);
  const next = new URLSearchParams(query);
  if (data.next !== null) next.set('after', data.next);
  const bulk = [];
  // The bulk refetch selects as the CLI does: by state, reason and prefix, never by text
  // inside a bundle ID (its selection is re-checked under each app's lock).
  if (full && query.get('state') === 'failed' && !query.get('has') && data.apps.length) {
    const where = {state: 'failed', reason: query.get('reason') || null, q: query.get('q') || ''};
    for (const [label, force] of [['Refetch', false], ['Force refetch', true]]) {
      bulk.push(el('button', {type: 'button', onclick: () => act(
        `${label} every failed app with reason ${where.reason || '(any)'} and bundle ID` +
        ` starting ${where.q || '(anything)'}, up to ${data.bulkLimit}?`,
        '/admin/api/refetch', {filter: where, force}, (r) => said(refetched(r)))},
      `${label} all matching (up to ${data.bulkLimit})`), ' ');
    }
  }
  // A search inside bundle IDs reads a window of apps a page: where it stopped, said.
  const searched = data.searchedTo === null ? null : el('p', {className: 'note', id: 'searched'},
    `Searched the bundle IDs up to ${data.searchedTo}` +
    (data.apps.length ? '.' : ' and found none yet.') + ' The next page searches on.');
  // Nothing starts so: perhaps it is further in (net.whatsapp.WhatsApp for "whatsapp").
  const hint = !data.apps.length && query.get('q') && !query.get('has') && !query.get('after') ?
    el('p', {className: 'note', id: 'try-contains'}, 'No bundle ID starts with that; ',
      el('a', {href: appsAddress({...Object.fromEntries(query), q: '', has: query.get('q')})},
        'search for it anywhere in the bundle ID'), '.') : null;
  show(el('h1', {}, 'Apps'), filters, el('div', {id: 'outcome'}), ...bulk, searched, hint,
    table(['bundle ID', 'state', 'failure', 'version', 'result stored', 'leased to'], rows),
    data.next !== null ? el('a', {href: '/admin/apps?' + next, id: 'next'},
      data.searchedTo === null ? 'Next page' : 'Search on') : null);
}

async function app(id) {
  const data = await api('/admin/api/apps/' + encodeURIComponent(id));
  const a = data.app;
  // A hold is said once, from its fields (who, when, why); any other verdict in the
  // server's words. Times as how long ago, the exact UTC time on hover.
  const hold = data.why.hold;
  const verdict = hold ? el('span', {id: 'hold'}, `Held by ${when(hold.by)}, `, ago(hold.at),
    ': never handed out until released. ', hold.reason ? `Reason: ${hold.reason}` :
      'No reason given.', /its live lease runs to its end/.test(data.why.why) ?
      ' Its live lease runs to its end.' : '') : sentence(data.why.why);
  const why = el('div', {className: 'why' + (data.why.candidate ? ' candidate' : ''), id: 'why'},
    el('strong', {}, data.why.candidate ? 'Handed out now. ' : 'Not handed out now. '),
    verdict, data.why.from ? el('span', {}, ' Handed out from ', ago(data.why.from), '.') : '');
  const retry = data.why.retry;
  const retries = retry ? el('p', {id: 'retry'}, `Failures in a row: ${retry.consecutiveFailures}. `,
    ...(retry.nextRetry === null ? ['No retry left (RETRY_BACKOFF).'] :
      ['Next retry: ', ago(retry.nextRetry), `, ${retry.due ? 'due now' : 'not due yet'}.`])) :
    null;
  const paused = data.why.queuePaused ? el('p', {className: 'warn', id: 'queue-paused'},
    'The whole queue is paused (since ', ago(data.why.queuePaused), '): ',
    el('a', {href: '/admin'}, 'see the overview'), '.') : null;
  const buttons = [];
  if (full) {
    for (const [label, force] of [['Refetch', false], ['Force refetch', true]]) {
      buttons.push(el('button', {type: 'button', onclick: () => act(`${label} ${a.appId}?`,
        '/admin/api/refetch', {appIds: [a.appId], force}, (r) => {
          const text = refetched(r);
          route().then(() => said(text));  // the page drawn again, then what was done
        })}, label), ' ');
    }
    buttons.push(hold ? el('button', {type: 'button', onclick: () => act(`Release ${a.appId}?` +
      ' The rule decides again whether it is handed out.',
    '/admin/api/apps/' + encodeURIComponent(a.appId) + '/release', {}, (r) => {
      route().then(() => said(r.outcome === 'released' ? `${r.appId} is released.` :
        `${r.appId} was not held.`));
    })}, 'Release') : holdForm(a.appId));
  }
  // The last failure's log, unless it is the current result shown above (no field twice).
  const currentIsFailure = a.analysis !== null && typeof a.analysis === 'object' &&
    a.analysis.success === false;
  const log = currentIsFailure ? [] : data.history.filter((h) => h.failure_log !== null);
  show(el('h1', {}, a.appId), why, retries, paused, el('div', {id: 'outcome'}), ...buttons,
    table(['state', 'failure', 'version', 'result stored', 'added', 'leased to', 'since',
      'lease attempts', 'analysed by'],
      [[a.status, when(data.failureReason), when(a.analysisVersion), ago(a.analysed),
        ago(a.added), when(a.claimedBy), ago(a.processingStarted), data.leaseAttempts,
        when(a.analysedBy)]]),
    el('h2', {}, 'Details'), el('pre', {}, JSON.stringify(a.details, null, 2)),
    el('h2', {}, 'Current result'),
    el('pre', {id: 'analysis'}, JSON.stringify(a.analysis, null, 2)),
    el('h2', {}, 'History, newest first'),
    table(['analysed', 'version', 'source', 'success', 'reason', 'analyser'],
      data.history.map((h) => [ago(h.analysed), when(h.analysisversion),
        source(h.analysis_source), String(h.success), when(h.reason), when(h.analyser)])),
    log.length ? el('h2', {}, 'Last failure log') : null,
    log.length ? el('pre', {}, JSON.stringify(log[0].failure_log, null, 2)) : null,
    el('h2', {}, 'Operator actions'),
    table(['when', 'who', 'from', 'what', 'outcome'], data.actions.map((x) =>
      [ago(x.at), x.actor, x.source, x.action, when(x.outcome)])));
}

const HELD = {held: 'is held.', already_held: 'was held already: nothing changed.',
  waiting: 'is held; its live lease runs to its end.',
  lease_broken: 'is held; its lease was broken (force): back to its stored result.'};
// Hold: a reason (optional) and whether to break a live lease (force).
function holdForm(appId) {
  const reason = el('input', {name: 'reason', size: 40, maxlength: 500});
  const force = el('input', {type: 'checkbox', name: 'force'});
  const form = el('form', {id: 'hold-app'}, el('label', {}, 'Reason (optional) ', reason), ' ',
    el('label', {}, force, ' break a live lease (force)'), ' ',
    el('button', {type: 'submit'}, 'Hold'));
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    const body = {force: force.checked};
    if (reason.value) body.reason = reason.value;
    act(`Hold ${appId}? It is never handed out until released.` +
      (force.checked ? ' A live lease on it is broken.' : '') +
      (reason.value ? ` Reason: ${reason.value}` : ''),
    '/admin/api/apps/' + encodeURIComponent(appId) + '/hold', body, (r) => {
      route().then(() => said(`${r.appId} ${HELD[r.outcome] || r.outcome}`));
    });
  });
  return form;
}

async function analysers() {
  const data = await api('/admin/api/analysers');
  const rows = data.analysers.map((a) => {
    const path = '/admin/api/analysers/' + encodeURIComponent(a.name);
    const cells = [a.name, ago(a.lastSeen), a.online ? 'yes' : 'no',
      a.holding ? appLink(a.holding.appId) : '-',
      when(a.results24h), when(a.failures24h), ago(a.revoked), String(a.consecutiveFailures),
      // Its failures in a row began then; once they stop (a success, a resume), when its
      // last run of them began, still what "Refetch what it failed" starts from.
      a.failingSince === null ? '-' : a.consecutiveFailures > 0 ? ago(a.failingSince) :
        el('span', {}, 'none now; the last run began ', ago(a.failingSince)),
      a.broken ? el('strong', {className: 'warn'}, 'broken') : 'no',
      a.paused ? el('span', {}, `paused by ${when(a.paused.by)}, `, ago(a.paused.at)) : 'no'];
    const actions = [];
    if (full && !a.revoked) {
      // How long the old token keeps working after a rotation.
      const overlap = el('select', {'aria-label': 'overlap'},
        ...['24h', '7d', '1h', '0'].map((o) => el('option', {value: o}, o === '0' ? 'none' : o)));
      actions.push(
        el('button', {type: 'button', onclick: () => act(`Rotate the token of ${a.name}? The` +
          ` old one keeps working for ${overlap.selectedOptions[0].text}.`,
        path + '/rotate', {overlap: overlap.value}, newToken)}, 'Rotate'), ' overlap ', overlap, ' ',
        el('button', {type: 'button', onclick: () => act(`Revoke ${a.name}? Its tokens stop` +
          ' working at once.', path + '/revoke', {}, () => route())}, 'Revoke'), ' ',
        a.paused ?
          el('button', {type: 'button', onclick: () => act(`Resume ${a.name}? It is handed apps` +
            ' again, and its failures in a row are counted from none (refetch what it failed' +
            ' first, if that is to be done).', path + '/resume', {}, paused)}, 'Resume') :
          el('button', {type: 'button', onclick: () => act(`Pause ${a.name}? It is handed no app` +
            ' until it is resumed; a lease it holds stays its own.', path + '/pause', {}, paused)},
          'Pause'));
    }
    if (full && a.failingSince !== null) {
      actions.push(' ', el('button', {type: 'button', onclick: () => refetchFailedBy(a)},
        'Refetch what it failed since it began failing'));
    }
    if (full) cells.push(actions.length ? el('span', {className: 'actions'}, ...actions) : '');
    const row = el('tr', {className: [a.broken ? 'broken' : '', a.paused ? 'paused' : '']
      .join(' ').trim()}, ...cells.map((cell) => el('td', {}, cell)));
    row.dataset.analyser = a.name;
    return row;
  });
  // A pattern is compiled with the v flag, where a literal - in a class must be escaped.
  const name = el('input', {name: 'name', required: '', pattern: '[A-Za-z0-9._:@\\-]{1,64}'});
  const add = el('form', {id: 'add-analyser'}, el('label', {}, 'Name ', name), ' ',
    el('button', {type: 'submit'}, 'Add analyser'));
  add.addEventListener('submit', (event) => {
    event.preventDefault();
    act(`Add the analyser ${name.value}?`, '/admin/api/analysers', {name: name.value}, newToken);
  });
  const headers = ['name', 'last seen', 'online', 'holds', 'results, last 24 hours',
    'failures, last 24 hours', 'revoked', 'failures in a row', 'failing since', 'broken',
    'paused'];
  show(el('h1', {}, 'Analysers'), full ? add : null, el('div', {id: 'outcome'}),
    el('table', {id: 'analysers-table'},
      el('tr', {}, ...(full ? [...headers, ''] : headers).map((h) => el('th', {}, h))),
      ...rows));
}
function paused(result) {
  const text = {paused: 'is paused.', resumed: 'is resumed.',
    unchanged: result.paused ? 'was paused already.' : 'was not paused.'};
  analysers().then(() => said(`${result.name} ${text[result.outcome] || result.outcome}`));
}
// What an analyser failed since its failures in a row began (failingSince): first what a
// refetch would do (a dry run, changing nothing), then, asked once, the refetch.
async function refetchFailedBy(a) {
  const where = {state: 'failed', failedBy: a.name, since: a.failingSince};
  const out = document.getElementById('outcome');
  let dry;
  try { dry = await api('/admin/api/refetch', {filter: where, dryRun: true}); } catch (error) {
    out.replaceChildren(el('p', {className: 'error'}, error.message));
    return;
  }
  const o = dry.outcomes;
  said(`Dry run: ${dry.selected} apps failed by ${a.name} since ${a.failingSince}` +
    `${dry.more ? ' (the first of more)' : ''}: ${o.queued} would be queued now, ${o.waiting}` +
    ` would wait for a lease to end, ${o.lease_broken} would have the lease broken,` +
    ` ${o.skipped} would be left as they are.`);
  if (dry.selected === 0) return;
  act(`Refetch the ${dry.selected} apps ${a.name} failed since ${a.failingSince}?`,
    '/admin/api/refetch', {filter: where}, (r) => {
      const text = refetched(r) + (r.more ? ' More remain: refetch again.' : '');
      analysers().then(() => said(text));
    });
}
// A new token, shown once: here, in this answer, never again.
function newToken(result) {
  analysers().then(() => document.getElementById('outcome').replaceChildren(
    el('p', {}, `The token of ${result.name}, shown this once:`),
    el('p', {className: 'token', id: 'new-token'}, result.token)));
}

let refresh = null;
function route() {
  clearInterval(refresh);
  const path = location.pathname;
  if (path === '/admin') {
    refresh = setInterval(() => {
      if (document.visibilityState === 'visible') overview().catch(failed);
    }, 30000);
    return overview().catch(failed);
  }
  if (path === '/admin/apps') return apps().catch(failed);
  if (path === '/admin/analysers') return analysers().catch(failed);
  if (path === '/admin/actions') return actions().catch(failed);
  if (path.startsWith('/admin/apps/')) {
    let id;
    try { id = decodeURIComponent(path.slice('/admin/apps/'.length)); } catch (error) {
      return failed(new Error('not an app address: ' + path));
    }
    return app(id).catch(failed);
  }
}
// Signed out when the server says so (or finds no session left to end); on an error
// (503, 403) the page says why and the session stays as it is.
document.getElementById('sign-out').addEventListener('click', () => {
  api('/admin/logout', {}).then(() => location.assign('/admin/login?signed-out')).catch(failed);
});
document.addEventListener('visibilitychange', () => {
  if (document.visibilityState === 'visible' && location.pathname === '/admin') {
    overview().catch(failed);
  }
});
route();
