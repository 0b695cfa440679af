"""Diagnosis of hangs and desyncs: stall reports, the fingerprint check and the flight recorder.

``IProcessGroup`` talks to one object of this package, ``Diagnostics``: it starts it
once connected (``Diagnostics.start``), hands it every operation
(``Diagnostics.issue``, ``Diagnostics.issue_p2p``) and closes it. The rest is its parts:

- ``watchdog``: stall reports; ``fingerprint``: what each rank is about to call, compared under
  ``COMMLIB_DEBUG=DETAIL``; ``sidechannel``: the small TCP hub they talk over; ``deferred``: the
  launcher thread that checks asynchronous collectives in order; ``flight_recorder``: the last N
  operations of each group, dumped when something goes wrong.
"""

from commlib.diagnosis.diagnostics import DiagnosedGroup, Diagnostics, FingerprintExchange

__all__ = ["DiagnosedGroup", "Diagnostics", "FingerprintExchange"]
