"""Sign-in and sign-out pages, and the page that says why there is nothing to sign in to."""

from __future__ import annotations

from urllib.parse import quote, urlsplit

from flask import Blueprint, redirect, render_template, request, url_for
from werkzeug.wrappers import Response as BaseResponse

from web import auth
from web.services import services

bp = Blueprint("signin", __name__)

#: The longest ``next`` kept; a longer one is not a page of ours.
_NEXT_MAX = 2000

#: The README section on the shapes wheelhouse runs in, builds included (``home.readme``).
BUILDS_SECTION = "Running it for real"


def _safe_next(target: str | None) -> str:
    """Only same-site paths: a sign-in must never bounce to another host.

    Browsers drop tabs, CR and LF from URLs and read a backslash as a slash, so ``/%09/evil``
    (a tab, once the query is decoded) would become ``//evil``, another host: any control
    character, backslash, scheme or host refuses the target, as does a path that doesn't start
    with exactly one slash.
    """
    fallback = url_for("matrixpage.matrix")
    if not target or len(target) > _NEXT_MAX or "\\" in target \
            or any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in target):
        return fallback
    try:
        parts = urlsplit(target)
    except ValueError:  # e.g. an unbalanced "[" taken for an IPv6 host
        return fallback
    # "///evil" parses with an empty host, but browsers skip any number of slashes there.
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return fallback
    return target


def login_redirect() -> BaseResponse:
    """To the sign-in page, and back to this page after it."""
    return redirect(url_for("signin.login", next=request.full_path.rstrip("?")))


def no_build_queue() -> tuple[str, int]:
    """What ``/request`` and ``/login`` answer in index-only mode: builds need Redis and a
    worker, and how to get them (a sign-in form could never succeed here)."""
    readme = url_for("home.readme") + "#:~:text=" + quote(BUILDS_SECTION)
    return render_template("no_queue.html", readme=readme, section=BUILDS_SECTION), 503


@bp.route("/login", methods=["GET", "POST"])
def login() -> BaseResponse | tuple[str, int] | str:
    error = None
    nxt = _safe_next(request.values.get("next"))
    if services().tokens is None and request.method == "GET":
        return no_build_queue()
    if request.method == "POST":
        auth.check_csrf()
        tokens = services().tokens
        if tokens is None:
            error = "This server has no build queue, so there is nothing to sign in to."
            return render_template("login.html", error=error, next=nxt), 401
        auth.refuse_if_locked_out()  # the right token too, until the lockout ends
        info = tokens.verify(request.form.get("token", "").strip())
        if info is None:
            auth.failed_sign_in()
            error = "That token is not valid (or was revoked)."
            return render_template("login.html", error=error, next=nxt), 401
        auth.login(info)
        return redirect(nxt)
    return render_template("login.html", error=error, next=nxt)


@bp.post("/logout")
def logout() -> BaseResponse:
    auth.check_csrf()
    auth.logout()
    return redirect(url_for("matrixpage.matrix"))
