"""What a person sees of a run: the event log, the live terminal view, the report, the
dashboard and its metrics. Only reads what the coordinator publishes; nothing in a round
waits for it. Heavy libraries (rich, matplotlib, hypercorn, prometheus-client) are imported
by the module that needs them, when it is used."""
