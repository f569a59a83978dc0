// Copy buttons for install commands. Without this script the commands are plain, selectable
// text (one click selects a whole command: `user-select: all`), so nothing depends on it.
(function () {
  "use strict";
  function copied(button) {
    button.textContent = "Copied";
    window.setTimeout(function () { button.textContent = "Copy"; }, 1500);
  }
  function fallback(el, button) {
    var range = document.createRange();
    range.selectNodeContents(el);
    var selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
    try { if (document.execCommand("copy")) { copied(button); } } catch (e) { /* selected */ }
  }
  function add(el) {
    var button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.setAttribute("aria-label", "Copy the command");
    button.addEventListener("click", function () {
      var text = el.textContent.trim();
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(function () { copied(button); },
                                                 function () { fallback(el, button); });
      } else {
        fallback(el, button);  // plain http on another host: no clipboard API
      }
    });
    el.insertAdjacentElement("afterend", button);
  }
  document.querySelectorAll(".copyable").forEach(add);
}());
