import os
import signal

# Ctrl-C before the command line's own handling is in place (cli.exit_at_once_on_ctrl_c): exit 130, no traceback.
signal.signal(signal.SIGINT, lambda signum, _frame: os._exit(128 + signum))
from specdecode.cli import main  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)
raise SystemExit(main())
