package kernscope_test

import (
	"errors"
	"fmt"

	ks "github.com/kernscope/kernscope/bindings/go"
)

func Example() {
	x := []float32{1, 2, 3, 4, -1, 0.5, 2, 8}
	w := []float32{1, 1, 0.5, 2}
	y := make([]float32, 8)
	if err := ks.RMSNorm(ks.F32(y, 2, 4), ks.F32(x, 2, 4), ks.F32(w, 4), 1e-6); err != nil {
		panic(err)
	}
	fmt.Printf("%.4f\n", y[0])

	err := ks.RMSNorm(ks.F32(y, 2, 4), ks.F32(x, 2, 4), ks.F32(w, 4), 0)
	var ke *ks.Error
	fmt.Println(errors.Is(err, ks.ErrInvalidArgument), errors.As(err, &ke) && ke.Status == ks.StatusInvalidArgument)
	// Output:
	// 0.3651
	// true true
}
