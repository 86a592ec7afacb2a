"""apply_steering: ``hidden[t] += table[index[t]]`` in place, skipped when the table is idle."""
