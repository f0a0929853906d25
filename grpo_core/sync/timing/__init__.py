"""What bounds a push in time: each phase's deadline, and the server calls made under it.

``deadline`` sets each phase's limit from its bytes and the bandwidth measured on earlier pushes (``Deadlines``,
``PhaseClock``); ``timed_control.TimedControl`` sends each weight-sync route with its phase's limit as the HTTP
timeout. Every sync and sender that waits on a server waits through these, and a phase that passes its limit raises
``errors.WeightSyncTimeout``.
"""
