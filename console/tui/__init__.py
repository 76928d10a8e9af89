"""The Textual console: the app and its screens, the browser view, and the widgets.

Everything here draws what :mod:`elastic_console.job` reads and folds; nothing here talks to
Redis except through that room's client.
"""
