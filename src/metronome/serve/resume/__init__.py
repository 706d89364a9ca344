"""Resuming a session: after a dropped connection on the same server (a lease, a token, the
events it missed: `lease`, `event_log`), or on another server from a checkpoint (`checkpoint`:
the format and the store; `takeover`: when to checkpoint, the client events logged since,
claiming and restoring). `resumer` is the server's side of all of it."""
