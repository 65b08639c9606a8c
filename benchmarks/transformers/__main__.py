from benchmarks.transformers.main import main

main()
