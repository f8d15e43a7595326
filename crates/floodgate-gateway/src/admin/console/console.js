// floodgate console: reads only the admin API on this listener. No framework, no build step;
// every value from the API is put in the page as text (textContent), never as markup.
"use strict";

const REFRESH_MS = 3000;
const PAGE_SIZE = 50;
const READ_KEY = "floodgate.console.read";
const CHART_DAYS = 14;

let csrf = null;
let view = "notifications";
let timer = null;
// Usage paging: the cursors of the pages before this one, and this one's.
let cursors = [];
let cursor = null;
let nextCursor = null;
let resetTarget = null;

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

function refresh() {
  // The badge counts unread alerts whichever view is open.
  loadAlerts().catch(() => {});
  if (view === "usage") loadUsage().catch((e) => { $("usage-error").textContent = e.message; });
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

/// The last CHART_DAYS days up to `lastDay` (YYYY-MM-DD), oldest first.
function daysUpTo(lastDay) {
  const days = [];
  const end = new Date(lastDay + "T00:00:00Z");
  for (let i = CHART_DAYS - 1; i >= 0; i--) {
    const d = new Date(end.getTime() - i * 86400000);
    days.push(d.toISOString().slice(0, 10));
  }
  return days;
}

function chart(alerts, subject, lastDay) {
  const counts = new Map();
  for (const a of alerts) if (subjectOf(a) === subject) counts.set(a.day, a.count);
  const days = daysUpTo(lastDay);
  const max = Math.max(1, ...days.map((d) => counts.get(d) || 0));
  const box = el("div", { class: "chart", role: "img",
    "aria-label": subject + ": refusals over the last " + CHART_DAYS + " days" });
  for (const d of days) {
    const n = counts.get(d) || 0;
    const bar = el("span", { title: d + ": " + n, "data-day": d, "data-count": n });
    if (n === 0) bar.className = "zero";
    bar.style.height = Math.max(1, Math.round((n / max) * 32)) + "px";
    box.append(bar);
  }
  return box;
}

async function loadAlerts() {
  const { alerts } = await api("/admin/alerts");
  const read = readSet();
  const list = $("alerts");
  const items = [];
  let day = null;
  let unread = 0;
  for (const a of alerts) {
    if (a.day !== day) {
      day = a.day;
      items.push(el("li", { class: "day-heading" }, a.day));
    }
    const id = alertId(a);
    const isRead = read.has(id);
    if (!isRead) unread++;
    const mark = el("button", { type: "button", class: "mark" }, isRead ? "Mark unread" : "Mark read");
    mark.addEventListener("click", () => {
      const set = readSet();
      if (set.has(id)) set.delete(id); else set.add(id);
      saveRead(set);
      loadAlerts().catch(() => {});
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
      chart(alerts, subject, alerts[0].day),
      mark));
  }
  list.replaceChildren(...items);
  $("no-alerts").hidden = alerts.length > 0;
  $("unread").hidden = unread === 0;
  $("unread").textContent = unread;
}

function markAllRead() {
  const set = readSet();
  for (const li of document.querySelectorAll("#alerts .alert")) {
    set.add(li.dataset.alert);
  }
  saveRead(set);
  loadAlerts().catch(() => {});
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
  if (cursor) params.set("cursor", cursor);
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
  nextCursor = usage.next_cursor;
  const first = cursor ? Number(cursor) + 1 : 1;
  $("page-info").textContent = usage.total === 0 ? "no scopes match"
    : first + "–" + (first + usage.scopes.length - 1) + " of " + usage.total;
  $("prev-page").disabled = cursors.length === 0;
  $("next-page").disabled = !nextCursor;
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
  cursors = [];
  cursor = null;
  loadUsage().catch((e) => { $("usage-error").textContent = e.message; });
}

// ---- start -----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", async () => {
  $("signin-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", signOut);
  $("tab-notifications").addEventListener("click", () => show("notifications"));
  $("tab-usage").addEventListener("click", () => show("usage"));
  $("mark-all").addEventListener("click", markAllRead);
  $("filter-kind").addEventListener("change", filterChanged);
  $("filter-id").addEventListener("input", filterChanged);
  $("prev-page").addEventListener("click", () => { cursor = cursors.pop() || null; loadUsage().catch(() => {}); });
  $("next-page").addEventListener("click", () => {
    if (!nextCursor) return;
    cursors.push(cursor);
    cursor = nextCursor;
    loadUsage().catch(() => {});
  });
  $("confirm").addEventListener("close", onConfirmClose);
  const response = await fetch("/console/session", { credentials: "same-origin" });
  if (response.ok) showApp(await response.json());
  else showSignIn();
});
