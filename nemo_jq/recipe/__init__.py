"""The training recipe, read top to bottom: the run's parts built from its config (components), the experience of a
step (experience, sequences), one optimizer batch's gradient (learn), evaluation, the collapse guard, the loop and
what its checkpoint remembers (trainer, state), and the embedded demo."""
