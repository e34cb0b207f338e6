from driver.cli import main

raise SystemExit(main())
