"""Metric logging behind one small interface: MLflow for runs, the console for people.

``tracker`` (``make_tracker`` and the trackers, run identity, the final model logged to MLflow) and
``outbox`` (writes delivered in order by a background thread, retried while the server is down).
"""
