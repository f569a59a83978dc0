// Live build page: polls the JSON API and updates state, progress and log in place.
// Progressive enhancement: without this script the page is complete as rendered.
(function () {
  "use strict";
  var root = document.getElementById("build");
  if (!root || !window.fetch) { return; }
  var apiUrl = root.dataset.api, logUrl = root.dataset.log;
  var logEl = document.getElementById("log");
  var offset = null;  // line number the next log poll starts from
  var finished = false;
  var FINAL = { built: 1, failed: 1, cancelled: 1 };

  function text(id, value) {
    var el = document.getElementById(id);
    if (el) { el.textContent = value; }
  }
  function duration(s) {
    if (s === null || s === undefined) { return "\u2014"; }
    s = Math.floor(s);
    if (s < 60) { return s + " s"; }
    if (s < 3600) { return Math.floor(s / 60) + " min " + String(s % 60).padStart(2, "0") + " s"; }
    return Math.floor(s / 3600) + " h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + " min";
  }
  function bytes(n) {
    if (!n) { return "\u2014"; }
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return i ? n.toFixed(1) + " " + units[i] : n + " B";
  }

  function render(b) {
    var state = document.getElementById("state");
    state.textContent = b.state;
    state.className = "state " + b.state;
    root.dataset.state = b.state;
    text("phase", b.phase && !b.finished ? "(" + b.phase + ")" : "");
    text("position", b.position === null ? "\u2014" : (b.position + 1) + (b.position === 0 ? " (next)" : ""));
    var pct = b.progress ? b.progress.percent : (b.state === "built" ? 100 : 0);
    document.getElementById("bar-fill").style.width = pct + "%";
    document.getElementById("bar").setAttribute("aria-valuenow", pct);
    // The server never claims the end before it comes: past the last compile step the build
    // is "finishing" (linking, packing, uploading), with no count left to extrapolate.
    var counted = b.finishing ? "finishing" : (b.progress ? b.progress.percent + "%" : "");
    text("progress-text", b.progress ? "[" + b.progress.done + "/" + b.progress.total + "] " + counted
                                     : (b.finishing ? "finishing" : "\u2014"));
    text("elapsed", duration(b.elapsed_seconds));
    var est = [];
    if (b.finishing) { est.push("finishing (linking, packing, uploading)"); }
    else if (b.remaining_seconds !== null) { est.push("about " + duration(b.remaining_seconds) + " left"); }
    if (b.estimate_seconds !== null) { est.push("(earlier builds took " + duration(b.estimate_seconds) + ")"); }
    text("estimate", est.length ? est.join(" ") : "\u2014");
    text("max-jobs", b.max_jobs === null ? "\u2014" : String(b.max_jobs) + (b.max_jobs_reason ? " (" + b.max_jobs_reason + ")" : ""));
    if (b.max_jobs_charge) { text("max-jobs-charge", b.max_jobs_charge); }
    text("peak-memory", bytes(b.peak_memory_bytes));
    text("sandbox", b.sandbox || "\u2014");
    text("steps", b.steps || "\u2014");
    document.getElementById("sandbox").className = b.sandbox && b.sandbox.indexOf("off") === 0 ? "unsafe" : "";
    if (FINAL[b.state]) {
      finished = true;
      var cancel = document.getElementById("cancel-form");
      if (cancel) { cancel.remove(); }
      // The outcome (install command, classified reason) is rendered by the server.
      if (root.dataset.rendered !== b.state) { window.setTimeout(function () { window.location.reload(); }, 800); }
    }
  }

  function pollLog() {
    var url = logUrl + "?offset=" + (offset === null ? 0 : offset);
    return fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data) { return; }
        if (offset === null) { logEl.textContent = ""; }
        if (data.lines.length) {
          var atBottom = logEl.scrollTop + logEl.clientHeight >= logEl.scrollHeight - 20;
          logEl.textContent += data.lines.join("\n") + "\n";
          var lines = logEl.textContent.split("\n");
          if (lines.length > 2000) { logEl.textContent = lines.slice(-2000).join("\n"); }
          if (atBottom) { logEl.scrollTop = logEl.scrollHeight; }
        }
        offset = data.next;
      });
  }

  function poll() {
    fetch(apiUrl, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (b) { if (b) { render(b); } return pollLog(); })
      .catch(function () { /* transient: try again next tick */ })
      .then(function () { if (!finished) { window.setTimeout(poll, 1000); } });
  }

  logEl.scrollTop = logEl.scrollHeight;  // the newest lines matter most
  root.dataset.rendered = root.dataset.state;
  if (!FINAL[root.dataset.state]) { poll(); }
}());
