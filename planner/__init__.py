"""`pdserve plan`: cost models fitted to steps timed on the target machine (profile.py,
costs.py), an event-by-event simulation of gateway, pools and transfers (simulate.py), and the
command that sizes xPyD for a rate and SLOs (cli.py)."""
