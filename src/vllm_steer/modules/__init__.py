"""Named steering modules: reusable vector sets registered once, referenced by name and scale."""
