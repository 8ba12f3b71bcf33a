"""Who is let in, and when: the gate, its adaptive limit, and the gate shared across processes."""
