"""Tandem as a local service people live with.

    units.py        the launchd LaunchAgent and the systemd --user unit, as text (pure)
    control.py      tandem service install | uninstall | start | stop | status | logs
    pull.py         tandem pull --isq: conversion (the download is app.engine.models.hub's, shared with the server)
    models_file.py  adding an entry to models.yaml by editing its text (comments stay)
    status.py       tandem ps / tandem models, read from the server's /health
    cli.py          where these sit on the command line (registered by app/cli.py)

No Litestar here: these are clients of the server (over HTTP) and of the service manager.
"""
