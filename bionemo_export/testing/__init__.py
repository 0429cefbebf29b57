"""What tests, benchmarks and demos need that serving does not: small random checkpoints of every
model family (`checkpoints`). Nothing in the serving path imports this package."""
