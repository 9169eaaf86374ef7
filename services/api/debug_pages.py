"""The debug pages' HTML: ``/debug/requests``, the recent requests' index (a request's waterfall
page is ``shared.timeline.render_html``). Self-contained pages: no script, no external asset."""

from __future__ import annotations

import html
import urllib.parse

from shared import history


def requests_index_html(summaries: list[history.Summary], *, status: str | None, since_s: float) -> str:
    """The ``/debug/requests`` page: a self-contained table (no script, no external asset) that
    fits a 1280 px wide window: fixed column widths, ids cut with an ellipsis (whole in their
    tooltip), errors wrapped."""
    e = html.escape

    def ms(seconds: float | None) -> str:
        return "" if seconds is None else f"{seconds * 1e3:.0f}"

    rows = []
    for s in summaries:
        tokens = "" if s.completion_tokens is None else f"{s.prompt_tokens or 0} / {s.completion_tokens}"
        link = f"/debug/requests/{urllib.parse.quote(s.request_id, safe='')}"
        received = history.iso_time(s.received_at)  # (the time of day shown; the date in its tooltip)
        rows.append(
            f'<tr class="{e(s.status)}"><td class="id" title="{e(s.request_id)}"><a href="{e(link)}">'
            f'{e(s.request_id)}</a></td><td title="{e(received)}">{e(received[11:])}</td><td>{e(s.status)}</td>'
            f'<td class="n">{s.images}</td><td class="n">{tokens}</td><td class="n">{ms(s.ttft_s)}</td>'
            f'<td class="n">{ms(s.e2e_s)}</td><td class="err">{e(s.error)}</td>'
            f'<td class="id" title="{e(s.replay_of)}">{e(s.replay_of)}</td></tr>'
        )
    shown = f"status {e(status)}, " if status else ""
    widths = (28, 10, 7, 6, 9, 5, 5, 21, 9)  # percent: request, received, ..., error, replay of
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>epd-serve: recent requests</title><style>"
        "body{font:14px system-ui,sans-serif;margin:1.5em}"
        "table{border-collapse:collapse;width:100%;table-layout:fixed}"
        "td,th{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:top;"
        "overflow:hidden;text-overflow:ellipsis;white-space:nowrap}"
        "th{white-space:normal}td.id{font:12px ui-monospace,monospace}td.n{text-align:right}"
        "td.err{white-space:normal;overflow-wrap:anywhere}"
        "tr.error td,tr.cancelled td{color:#b3261e}tr.incomplete td{color:#8a6d00}</style></head><body>"
        f"<h1>Recent requests</h1><p>{len(summaries)} request(s), newest first ({shown}received within "
        f'{since_s:g} s). Filter: <a href="?status=error">errors</a>, <a href="?">all</a>; '
        "<code>?format=json</code> for the list.</p>"
        "<table><colgroup>"
        + "".join(f'<col style="width:{w}%">' for w in widths)
        + "</colgroup><tr><th>request</th><th>received (UTC)</th><th>status</th><th>images</th>"
        "<th>tokens (prompt / completion)</th><th>TTFT ms</th><th>E2E ms</th><th>error</th><th>replay of</th></tr>"
        + "".join(rows)
        + "</table></body></html>"
    )
