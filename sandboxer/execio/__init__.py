"""An exec's input and output: `stdio` (the three kinds of stdio an exec runs on), `pumps` (the
pipes between them and the command) and `terminal` (a pty of the exec's own). On exec's hot
path: nothing is imported here."""
