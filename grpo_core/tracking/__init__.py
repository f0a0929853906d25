"""Metric logging behind one small interface: MLflow for runs, the console for people.

``tracker`` (``make_tracker`` and the trackers, run identity, the final model logged to MLflow),
``outbox`` (writes delivered in order by a background thread, retried while the server is down) and
``run_view`` (how a run reads in MLflow's UI: the experiment's kind and runs view, the headline charts,
metrics the settings fix, param spelling and names, links).
"""
