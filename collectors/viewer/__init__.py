"""`trajstore view`: a read-only local web viewer of runs, rollouts, groups and episodes, down to the token.

app.py (routes, pages, JSON API), listing.py (the rollouts table: filters and the file-pruning
search), data.py (what each page reads), charts.py (inline SVG), templates/ and static/ (the
HTML, one stylesheet, one script; nothing is fetched from outside this server).
"""

from collectors.viewer.app import ViewerSettings, make_app, run, start_viewer, viewer_in_thread

__all__ = ["ViewerSettings", "make_app", "run", "start_viewer", "viewer_in_thread"]
