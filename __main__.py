from kvsidecar.daemon.main import main

raise SystemExit(main())
