module github.com/kernscope/kernscope/bindings/go

go 1.19
