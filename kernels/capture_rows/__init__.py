"""capture_rows: ``pool[plan[t]] = a[t] (+ b[t])`` for tokens whose plan entry is >= 0."""
