"""Diagnosis of hangs and desyncs: stall reports, the fingerprint check and the flight recorder.

- ``diagnostics``: ``Diagnostics``, one group's diagnosis, which ``IProcessGroup`` starts once
  connected and routes every collective through.
- ``watchdog``: stall reports; ``fingerprint``: what each rank is about to call, compared under
  ``COMMLIB_DEBUG=DETAIL``; ``sidechannel``: the small TCP hub they talk over; ``deferred``: the
  launcher thread that checks asynchronous collectives in order; ``flight_recorder``: the last N
  collectives of each group, dumped when something goes wrong.
"""
