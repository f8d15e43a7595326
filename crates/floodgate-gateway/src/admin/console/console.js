// floodgate console: reads only the admin API on this listener. No framework, no build step;
// every value from the API is put in the page as text (textContent), never as markup.
"use strict";

const REFRESH_MS = 3000;
const PAGE_SIZE = 50;
const READ_KEY = "floodgate.console.read";

let csrf = null;
let view = "notifications";
let timer = null;
let resetTarget = null;
// The page of alerts shown, kept to draw it again when one is marked read.
let shownAlerts = null;

// A list read a page at a time: the cursors of the pages before this one, this one's and the
// next one's, and the buttons and text under the list (`prefix` + "prev-page", ...); `empty`
// says that nothing matches.
function pager(prefix, load, empty) {
  const p = { before: [], at: null, next: null };
  const reload = () => load().catch(() => {});
  p.back = () => { p.at = p.before.pop() || null; reload(); };
  p.forward = () => {
    if (!p.next) return;
    p.before.push(p.at);
    p.at = p.next;
    reload();
  };
  p.first = () => { p.before = []; p.at = null; };
  // A page of `shown` items of `total`, followed by the page at `next` (null: the last).
  p.showing = (shown, total, next) => {
    p.next = next;
    const first = p.at ? Number(p.at) + 1 : 1;
    $(prefix + "page-info").textContent = total === 0 ? empty
      : first + "–" + (first + shown - 1) + " of " + total;
    $(prefix + "prev-page").disabled = p.before.length === 0;
    $(prefix + "next-page").disabled = !next;
  };
  p.wire = () => {
    $(prefix + "prev-page").addEventListener("click", p.back);
    $(prefix + "next-page").addEventListener("click", p.forward);
  };
  return p;
}

const usagePages = pager("", () => loadUsage(), "no scopes match");
const alertPages = pager("alerts-", () => loadAlerts(), "");

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

async function api(path, options) {
  const opts = Object.assign({ credentials: "same-origin", headers: {} }, options || {});
  if (opts.method && opts.method !== "GET" && csrf) opts.headers["x-csrf-token"] = csrf;
  const response = await fetch(path, opts);
  if (response.status === 401) {
    showSignIn();
    throw new Error("not signed in");
  }
  if (!response.ok) {
    let message = response.status + "";
    try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(message);
  }
  return response.status === 204 ? null : response.json();
}

// ---- sign-in ---------------------------------------------------------------------------------

function showSignIn() {
  csrf = null;
  clearInterval(timer);
  timer = null;
  for (const id of ["notifications", "usage", "tabs", "sign-out"]) $(id).hidden = true;
  $("signin").hidden = false;
  $("secret").focus();
}

function showApp(session) {
  csrf = session.csrf;
  $("signin").hidden = true;
  $("tabs").hidden = false;
  $("sign-out").hidden = false;
  show(view);
}

async function signIn(event) {
  event.preventDefault();
  const button = event.target.querySelector("button");
  button.disabled = true;
  $("signin-error").textContent = "";
  try {
    const response = await fetch("/console/sign-in", {
      method: "POST",
      credentials: "same-origin",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ secret: $("secret").value }),
    });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error.message);
    $("secret").value = "";
    showApp(body);
  } catch (e) {
    $("signin-error").textContent = e.message;
  } finally {
    button.disabled = false;
  }
}

async function signOut() {
  try { await api("/console/sign-out", { method: "POST" }); } catch (_) { /* signed out anyway */ }
  showSignIn();
}

// ---- views -----------------------------------------------------------------------------------

function show(name) {
  view = name;
  for (const v of ["notifications", "usage"]) {
    $(v).hidden = v !== name;
    const tab = $("tab-" + v);
    if (v === name) tab.setAttribute("aria-current", "page");
    else tab.removeAttribute("aria-current");
  }
  refresh();
  clearInterval(timer);
  timer = setInterval(refresh, REFRESH_MS);
}

// Only the view shown is read again; elsewhere the badge reads the newest page alone.
function refresh() {
  if (view === "notifications") {
    loadAlerts().catch((e) => { $("alerts-error").textContent = e.message; });
  } else {
    loadUsage().catch((e) => { $("usage-error").textContent = e.message; });
  }
  if (view !== "notifications" || alertPages.at) loadBadge().catch(() => {});
}

// ---- notifications ---------------------------------------------------------------------------

function readSet() {
  try { return new Set(JSON.parse(localStorage.getItem(READ_KEY) || "[]")); } catch (_) { return new Set(); }
}

function saveRead(set) {
  localStorage.setItem(READ_KEY, JSON.stringify([...set]));
}

function alertId(a) {
  return a.day + "|" + a.subject + "|" + (a.key || "");
}

function subjectOf(a) {
  return a.subject === "key" ? "key " + a.key : "gateway";
}

/// The subject's name in a page's chart: `gateway` or `key:<id>`.
function chartName(a) {
  return a.subject === "key" ? "key:" + a.key : "gateway";
}

/// A subject's refusals on each of `days` (oldest first), as bars.
function chart(days, counts, subject) {
  const max = Math.max(1, ...counts);
  const box = el("div", { class: "chart", role: "img",
    "aria-label": subject + ": refusals over the last " + days.length + " days" });
  days.forEach((d, i) => {
    const n = counts[i] || 0;
    const bar = el("span", { title: d + ": " + n, "data-day": d, "data-count": n });
    if (n === 0) bar.className = "zero";
    bar.style.height = Math.max(1, Math.round((n / max) * 32)) + "px";
    box.append(bar);
  });
  return box;
}

/// The badge: unread alerts of the newest page (with a "+" when all are and more pages follow).
function showUnread(page) {
  const read = readSet();
  const unread = page.alerts.filter((a) => !read.has(alertId(a))).length;
  $("unread").hidden = unread === 0;
  $("unread").textContent = unread + (page.next_cursor && unread === page.alerts.length ? "+" : "");
}

async function loadBadge() {
  showUnread(await api("/admin/alerts?" + new URLSearchParams({ limit: PAGE_SIZE })));
}

async function loadAlerts() {
  const params = new URLSearchParams({ limit: PAGE_SIZE });
  if (alertPages.at) params.set("cursor", alertPages.at);
  const page = await api("/admin/alerts?" + params);
  $("alerts-error").textContent = "";
  shownAlerts = page;
  drawAlerts(page);
  alertPages.showing(page.alerts.length, page.total, page.next_cursor);
  if (!alertPages.at) showUnread(page);
}

function drawAlerts(page) {
  const read = readSet();
  const items = [];
  let day = null;
  for (const a of page.alerts) {
    if (a.day !== day) {
      day = a.day;
      items.push(el("li", { class: "day-heading" }, a.day));
    }
    const id = alertId(a);
    const isRead = read.has(id);
    const mark = el("button", { type: "button", class: "mark" }, isRead ? "Mark unread" : "Mark read");
    mark.addEventListener("click", () => {
      const set = readSet();
      if (set.has(id)) set.delete(id); else set.add(id);
      saveRead(set);
      redrawAlerts();
    });
    const subject = subjectOf(a);
    items.push(el("li", {
        class: "alert " + (isRead ? "read" : "unread"),
        "data-subject": subject, "data-day": a.day, "data-count": a.count, "data-alert": id,
      },
      el("div", {},
        el("div", {}, el("span", { class: "subject" }, subject), " ",
          el("span", { class: "count" }, a.count + (a.count === 1 ? " request" : " requests") + " refused (429)")),
        el("div", { class: "hint" }, a.message)),
      chart(page.chart.days, page.chart.subjects[chartName(a)] || [], subject),
      mark));
  }
  $("alerts").replaceChildren(...items);
  $("no-alerts").hidden = page.total > 0;
  $("alerts-pager").hidden = page.total === 0;
}

/// The page shown drawn again with the read state as it is now; the badge too on the newest.
function redrawAlerts() {
  if (!shownAlerts) return;
  drawAlerts(shownAlerts);
  if (alertPages.at) loadBadge().catch(() => {});
  else showUnread(shownAlerts);
}

function markPageRead() {
  const set = readSet();
  for (const li of document.querySelectorAll("#alerts .alert")) {
    set.add(li.dataset.alert);
  }
  saveRead(set);
  redrawAlerts();
}

// ---- usage -----------------------------------------------------------------------------------

function level(ratio) {
  if (ratio >= 0.9) return "full";
  if (ratio >= 0.7) return "warn";
  return "ok";
}

function duration(secs) {
  if (secs < 60) return secs + "s";
  if (secs < 3600) return Math.floor(secs / 60) + "m" + (secs % 60) + "s";
  return Math.floor(secs / 3600) + "h" + Math.floor((secs % 3600) / 60) + "m";
}

function usd(x) {
  return "$" + x.toFixed(x < 1 ? 4 : 2);
}

function limitRow(l) {
  const ratio = l.limit > 0 ? Math.min(1, l.used / l.limit) : 1;
  const fill = el("div", { class: "fill" });
  fill.style.width = (ratio * 100).toFixed(1) + "%";
  const bar = el("div", { class: "bar " + level(ratio), "data-used": l.used, "data-limit": l.limit }, fill);
  const label = l.kind + " / " + duration(l.window_sec) + (l.shadow ? " (shadow)" : "");
  return el("div", { class: "limit", "data-kind": l.kind },
    el("span", {}, label),
    bar,
    el("span", { class: "figures" },
      el("span", { class: "used" }, formatUsed(l.used) + " / " + l.limit),
      " · " + l.remaining + " left · whole in " + duration(l.reset_sec)));
}

function formatUsed(x) {
  return Number.isInteger(x) ? String(x) : x.toFixed(1);
}

function budgetRow(b) {
  const ratio = b.cap_usd > 0 ? Math.min(1, b.spent_usd / b.cap_usd) : 1;
  const fill = el("div", { class: "fill" });
  fill.style.width = (ratio * 100).toFixed(1) + "%";
  return el("div", { class: "limit", "data-kind": "budget-" + b.period },
    el("span", {}, "per " + b.period + (b.shadow ? " (shadow)" : "")),
    el("div", { class: "bar " + level(ratio) }, fill),
    el("span", { class: "figures" }, usd(b.spent_usd) + " / " + usd(b.cap_usd) +
      " · ends " + b.period_end.slice(0, 16).replace("T", " ") + " UTC"));
}

async function loadUsage() {
  const params = new URLSearchParams({ limit: PAGE_SIZE });
  const kind = $("filter-kind").value;
  const q = $("filter-id").value.trim();
  if (kind) params.set("scope", kind);
  if (q) params.set("q", q);
  if (usagePages.at) params.set("cursor", usagePages.at);
  const usage = await api("/admin/usage?" + params);
  $("usage-error").textContent = "";
  const rows = usage.scopes.map((s) => {
    const reset = el("button", { type: "button", class: "reset" }, "Reset");
    reset.addEventListener("click", () => confirmReset(s));
    return el("tr", { "data-scope": s.scope, "data-id": s.id },
      el("td", {}, el("div", { class: "scope-kind" }, s.scope.replace("_", " ")), el("div", {}, s.id),
        s.tenant !== s.scope + ":" + s.id && s.scope !== "gateway"
          ? el("div", { class: "hint" }, "in " + s.tenant) : ""),
      el("td", {}, ...(s.limits.length ? s.limits.map(limitRow) : [el("span", { class: "hint" }, "no rate limits")])),
      el("td", {}, ...(s.budgets.length ? s.budgets.map(budgetRow) : [el("span", { class: "hint" }, "-")])),
      el("td", {}, reset));
  });
  $("usage-rows").replaceChildren(...rows);
  usagePages.showing(usage.scopes.length, usage.total, usage.next_cursor);
  $("refreshed").textContent = "as of " + usage.now.slice(11, 19) + " UTC, " + usage.store + " store";
}

function confirmReset(scope) {
  resetTarget = scope;
  $("confirm-text").textContent = "Reset the windows of " + scope.scope.replace("_", " ") + " " + scope.id + "?";
  $("confirm-budgets").checked = false;
  $("confirm").showModal();
}

async function onConfirmClose() {
  const scope = resetTarget;
  resetTarget = null;
  if ($("confirm").returnValue !== "reset" || !scope) return;
  try {
    await api("/admin/reset", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ scope: scope.scope, id: scope.id, budgets: $("confirm-budgets").checked }),
    });
    await loadUsage();
  } catch (e) {
    $("usage-error").textContent = e.message;
  }
}

function filterChanged() {
  usagePages.first();
  loadUsage().catch((e) => { $("usage-error").textContent = e.message; });
}

// ---- start -----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", async () => {
  $("signin-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  $("tab-notifications").addEventListener("click", () => show("notifications"));
  $("tab-usage").addEventListener("click", () => show("usage"));
  $("mark-page").addEventListener("click", markPageRead);
  $("filter-kind").addEventListener("change", filterChanged);
  $("filter-id").addEventListener("input", filterChanged);
  usagePages.wire();
  alertPages.wire();
  $("confirm").addEventListener("close", onConfirmClose);
  const response = await fetch("/console/session", { credentials: "same-origin" });
  if (response.ok) showApp(await response.json());
  else showSignIn();
});
