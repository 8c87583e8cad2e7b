from gyre_async.cli.main import main

main()
