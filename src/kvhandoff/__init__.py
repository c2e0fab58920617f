"""kvhandoff."""
