"""Tools for a cluster job before and around a run: what it needs per GPU (plan), how it is submitted (launch), and
whether a node is ready for it (doctor)."""
